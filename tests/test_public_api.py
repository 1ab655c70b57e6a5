"""The public API is the package's `__all__`: importing it stays light, and the offline example
uses nothing else - and runs."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_omni_like

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "offline_batch.py"


def test_the_engines_are_exported_as_the_architecture_doc_says():
    for name in ("Omni", "AsyncOmni", "OmniRequest", "GenerationParams", "OmniRequestOutput"):
        assert name in vllm_omni_like.__all__
        assert getattr(vllm_omni_like, name).__name__ == name
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert "public names only: Omni, AsyncOmni" in doc


def test_the_offline_example_imports_only_the_public_api():
    imported = []
    for node in ast.walk(ast.parse(EXAMPLE.read_text())):
        if isinstance(node, ast.ImportFrom):
            assert node.module == "vllm_omni_like", node.module  # no submodule
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            assert not any(a.name.startswith("vllm_omni_like") for a in node.names)
    assert imported and set(imported) <= set(vllm_omni_like.__all__), imported


@pytest.mark.drill  # a fresh interpreter spawning the LLM and image workers: ~75 s on 2 cores
def test_the_offline_example_runs_and_writes_its_images(tmp_path):
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)], cwd=tmp_path, capture_output=True, text=True, timeout=110
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 3 and all(" -> offline-" in line for line in lines), done.stdout
    for i in range(3):
        png = (tmp_path / f"offline-{i}.png").read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 100
