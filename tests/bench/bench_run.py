"""A benchmark script of bench/ run as a user runs it: a fresh process from the repository's
root, the repository on its path; a failure shows the end of its stderr."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_bench(script: str, args: list[str], timeout: float) -> None:
    """`python bench/<script> <args>`, which must exit 0 within `timeout` seconds."""
    run = subprocess.run(
        [sys.executable, os.path.join("bench", script), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": ROOT},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert run.returncode == 0, run.stderr[-3000:]
