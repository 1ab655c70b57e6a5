"""The shipped trained defaults draw what they are asked (checked by the shapes checker)."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_omni_like.config import StageConfig
from vllm_omni_like.models.tiny import shipped_path
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.pipelines.catalog import TINY_OPTIONS
from vllm_omni_like.shapes import checker, world
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.wire import StageRequest

pytestmark = pytest.mark.slow


def _stage(kind: str, model: str):
    from vllm_omni_like.stages.base import create_stage

    stage = create_stage(
        StageConfig(name=kind, kind=kind, model=model, options=TINY_OPTIONS[model])
    )
    stage.load("cpu")
    return stage


def _control():
    return StageControl(FaultInjector((), "x"))


@pytest.fixture(scope="module")
def image_stage():
    return _stage("diffusion", "tiny-image")


def test_the_trained_weights_ship_with_the_package():
    import os

    total = 0
    for name in ("tiny-llm", "tiny-image", "tiny-video"):
        path = shipped_path(name)
        assert path is not None, f"{name} is not shipped"
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
        assert size < 10 * 2**20, (name, size)
        total += size
    assert total < 30 * 2**20


def test_a_batch_of_different_prompts_gets_each_its_own_picture(image_stage):
    scenes = [
        world.Scene("circle", "red", "top left", "blue"),
        world.Scene("square", "yellow", "bottom right", "black"),
        world.Scene("triangle", "white", "center", "green"),
        world.Scene("circle", "blue", "top right", "orange"),
    ]
    batch = [
        StageRequest(f"b{i}", s.caption(), GenerationParams(seed=i, num_inference_steps=15))
        for i, s in enumerate(scenes)
    ]
    outs = image_stage.execute(batch, _control())
    for scene, out in zip(scenes, outs, strict=True):
        read = checker.read_image(out.images[0].pixels)
        assert (read["colour"], read["background"]) == (scene.colour, scene.background), read
        assert read["position"] == scene.position, read


def test_the_same_seed_gives_the_same_image(image_stage):
    req = StageRequest(
        "s",
        world.Scene("square", "red", "left", "white").caption(),
        GenerationParams(seed=7, num_inference_steps=10),
    )
    a = image_stage.execute([req], _control())[0].images[0].pixels
    b = image_stage.execute([req], _control())[0].images[0].pixels
    assert np.array_equal(a, b)


def test_a_masked_edit_changes_only_the_masked_region(image_stage):
    # one shape per scene (as in training): repaint the shape's half with another colour
    base = world.render(world.Scene("square", "blue", "left", "white"))
    mask = np.zeros((64, 64), np.uint8)
    mask[:, :32] = 255  # repaint the left half (diffusers' convention: white = edit)
    req = StageRequest(
        "e",
        world.Scene("square", "red", "left", "white").caption(),
        GenerationParams(seed=3, num_inference_steps=20, strength=0.9),
        mode="edit",
        images=[base],
        mask=mask,
    )
    out = image_stage.execute([req], _control())[0].images[0].pixels.astype(int)
    kept = np.abs(out[:, 40:] - base[:, 40:].astype(int)).mean()
    changed = np.abs(out[:, :24] - base[:, :24].astype(int)).mean()
    assert kept < 10 and changed > 3 * kept, (kept, changed)
    read = checker.read_image(out.astype(np.uint8))
    assert (read["colour"], read["background"]) == ("red", "white"), read


@pytest.mark.parametrize(
    ("direction", "num_frames"), [("left", 9), ("right", 17), ("up", 25), ("down", 33)]
)
def test_the_video_shape_moves_in_the_asked_direction(direction, num_frames):
    """Trained on clips of 9 to 33 frames: a longer clip is not garbage, it moves slower."""
    stage = _video_stage()
    clip = world.Clip("circle", "yellow", "blue", direction)
    req = StageRequest(
        "v",
        clip.caption(),
        GenerationParams(seed=1, num_inference_steps=20, num_frames=num_frames),
        mode="text2video",
    )
    frames = stage.execute([req], _control())[0].video.frames
    assert frames.shape == (num_frames, 64, 64, 3)
    assert checker.motion(frames) == direction
    middle = checker.read_image(frames[num_frames // 2])
    assert middle["background"] == "blue", middle
    if num_frames <= 17:  # held out: colour 89% at 9 and 97% at 17 frames, 77% at 33
        assert middle["colour"] == "yellow", middle


_VIDEO = {}


def _video_stage():
    if "stage" not in _VIDEO:
        _VIDEO["stage"] = _stage("diffusion", "tiny-video")
    return _VIDEO["stage"]
