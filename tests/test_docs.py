"""The repository carries its own docs: nothing points outside it, and what they state of the
code holds (flags in docs/cli.md are checked by test_cli_help.py)."""

from __future__ import annotations

import os
import re

from vllm_omni_like.stages.diffusion.acceleration import DEFAULT_BUCKETS

ROOT = os.path.join(os.path.dirname(__file__), "..")
DOCS = ["README.md", "bench/README.md", "training/README.md"] + [
    f"docs/{name}" for name in os.listdir(os.path.join(ROOT, "docs"))
]


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def test_no_doc_points_outside_the_repository():
    for path in DOCS:
        assert "../shared" not in _read(path), path


def test_every_repository_path_a_doc_names_exists():
    for path in DOCS:
        for name in re.findall(
            r"`((?:docs|bench|training|examples|tools|tests)/[\w./-]+)`", _read(path)
        ):
            if "<" in name or "*" in name:
                continue
            assert os.path.exists(os.path.join(ROOT, name.split(":")[0])), (path, name)


def test_the_readme_states_the_default_batch_buckets():
    listed = ", ".join(str(b) for b in DEFAULT_BUCKETS)
    assert f"(default {listed} up to `--max-batch-size`)" in _read("README.md")
