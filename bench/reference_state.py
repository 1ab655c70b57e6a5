"""The reference's images (or frames) kept between a bench's GPU calls (`--state`), stamped
with the model and settings that made them, so a server run compares only against its own
model's reference.

A state file is an .npz: the arrays, and `__meta__` (the JSON of the model's name and its
settings). The default path names the model, and each setting given on the command line, so
two models (or two sizes of one) never share a file; a state made for other settings is
refused (`StateMismatch`) before the server starts, not compared against (a server run of one
model after another's reference once compared against the other's images: 12.9 dB).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from typing import Any

import numpy as np

META = "__meta__"


class StateMismatch(SystemExit):
    """The state file was made by another model or with other settings: exit with why."""


def default_path(kind: str, model: str, given: dict[str, Any]) -> str:
    """/tmp/<kind>-reference-<model>[-<setting><value>...].npz: `given`, the settings the
    command line overrides (None: not given)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(os.path.normpath(model)))
    tail = "".join(f"-{k}{v}" for k, v in sorted(given.items()) if v is not None)
    return os.path.join(tempfile.gettempdir(), f"{kind}-reference-{name}{tail}.npz")


def npz_path(path: str) -> str:
    """The path np.savez writes (it adds .npz where the name lacks it)."""
    return path if path.endswith(".npz") else f"{path}.npz"


def save(path: str, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    stamp = np.array(json.dumps(meta, sort_keys=True))
    np.savez(npz_path(path), **arrays, **{META: stamp})


def load(path: str, meta: dict[str, Any]) -> dict[str, np.ndarray] | None:
    """The arrays of the state at `path` made with `meta` (None: no state there); a state of
    another model or settings, or one without a stamp, raises `StateMismatch`."""
    path = npz_path(path)
    if not os.path.exists(path):
        return None
    with np.load(path) as f:
        if META not in f.files:
            raise StateMismatch(
                f"{path}: a reference state without its model's stamp; rerun the reference part"
            )
        saved = json.loads(str(f[META]))
        if saved != json.loads(json.dumps(meta, sort_keys=True)):
            raise StateMismatch(
                f"{path} holds the reference of {saved}, not of {meta}: rerun the reference "
                "part with these settings (or pass its --state)"
            )
        return {k: f[k] for k in f.files if k != META}
