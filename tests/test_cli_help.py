"""Every flag of `serve` and `generate` has help text that shows its default, and docs/cli.md
(written from the parser by tools/write_cli_doc.py) is current."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import pytest

from vllm_omni_like.cli import build_parser, help_texts

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_flag_has_help_that_shows_its_default(command):
    parser = _commands()[command]
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        text = (action.help or "") % {"default": action.default}
        if not text.strip() or not re.search(r"\(default[:s ]|\(required\)|default: ", text):
            missing.append((action.option_strings or [action.dest], text))
    assert not missing, missing


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_help_runs_and_every_flag_is_in_the_docs(command):
    out = subprocess.run(
        [sys.executable, "-m", "vllm_omni_like.cli", command, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "100"},
    )
    assert out.returncode == 0 and out.stderr == "", out.stderr
    with open(os.path.join(ROOT, "docs", "cli.md")) as f:
        doc = f.read()
    flags = set(re.findall(r"(--[a-z][a-z0-9-]+)", out.stdout))
    assert flags and {f for f in flags if f not in doc} == set()


def test_the_cli_doc_is_current():
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        from write_cli_doc import render
    finally:
        sys.path.pop(0)
    with open(os.path.join(ROOT, "docs", "cli.md")) as f:
        assert f.read() == render(), "docs/cli.md is stale: run python tools/write_cli_doc.py"
    assert set(help_texts()) == {"serve", "generate"}
