"""The example clients run against a live server without a warning or an error."""

from __future__ import annotations

import os

from tests.api.conftest import run_example


def test_the_openai_sdk_example_runs_clean(null_server, tmp_path):
    lines = run_example("openai_client.py", null_server, tmp_path)
    assert lines[2:5] == [
        "image_generation.partial_image",
        "image_generation.partial_image",
        "image_generation.completed",
    ]
    assert lines[-1].startswith("completed 100 ")
    assert sorted(os.listdir(tmp_path)) == ["clip.mp4", "image-0.png", "image-1.png"]
