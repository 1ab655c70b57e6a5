"""The command-line flags the benchmarks share, each said once: a script's parser, the model and
the parts it runs, the dtype, the compile mode, and where its results and its server's log go.
(No import from bench/ here: a script may import this as `bench.cli_flags` or, with bench/ on
its path, as `cli_flags`.)"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

RESULTS = "bench/results"


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's parser, described by the first line of its docstring."""
    return argparse.ArgumentParser(description=(doc or "").split("\n")[0])


def add_model(ap: argparse.ArgumentParser, model: str, parts: str, help: str | None = None) -> None:
    """--model (the one the script measures) and --parts (which of its parts run: a list)."""
    ap.add_argument("--model", default=model, help=help)
    ap.add_argument("--parts", default=parts)


def add_dtype(
    ap: argparse.ArgumentParser, dtypes: Iterable[str], default: str, auto: bool = False
) -> None:
    """--dtype, one of `dtypes` (raw_diffusers.DTYPES' names), or "auto" (the server's own
    choice) where `auto`."""
    names = sorted(dtypes)
    ap.add_argument("--dtype", default=default, choices=["auto", *names] if auto else names)


def add_compile_mode(ap: argparse.ArgumentParser) -> None:
    """--compile-mode, torch.compile's `mode` for the reference and the server alike."""
    ap.add_argument("--compile-mode", default="default")


def add_outputs(
    ap: argparse.ArgumentParser, log: str | None = None, out_dir: str = RESULTS
) -> None:
    """--log (the started server's log file; only where the script starts one) and --out-dir
    (where the results go)."""
    if log is not None:
        ap.add_argument("--log", default=log)
    ap.add_argument("--out-dir", default=out_dir)
