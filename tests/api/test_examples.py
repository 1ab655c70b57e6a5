"""The example clients run against a live server without a warning or an error."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_the_openai_sdk_example_runs_clean(null_server, tmp_path):
    out = subprocess.run(
        [sys.executable, "-W", "error", os.path.join(ROOT, "examples", "openai_client.py")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={**os.environ, "OPENAI_BASE_URL": f"{null_server.url}/v1", "OPENAI_API_KEY": "k"},
    )
    assert out.returncode == 0 and out.stderr == "", out.stderr
    lines = out.stdout.splitlines()
    assert lines[2:5] == [
        "image_generation.partial_image",
        "image_generation.partial_image",
        "image_generation.completed",
    ]
    assert lines[-1].startswith("completed 100 ")
    assert sorted(os.listdir(tmp_path)) == ["clip.mp4", "image-0.png", "image-1.png"]
