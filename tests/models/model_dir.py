"""Where a test builds a tiny model: a fresh temporary directory, removed when the test process
exits (the model is built once per process and read by its workers until then)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile


def model_dir(name: str) -> str:
    """A path `<new temporary directory>/<name>` for a model to be saved at."""
    root = tempfile.mkdtemp(prefix=f"{name}-")
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    return os.path.join(root, name)
