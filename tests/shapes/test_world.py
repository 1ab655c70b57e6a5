"""The shapes world and its checker, validated on ground truth and on noise."""

from __future__ import annotations

import dataclasses
import random

import numpy as np

from vllm_omni_like.shapes import checker, world


def _expected(scene: world.Scene) -> dict[str, str]:
    return {
        "colour": scene.colour,
        "background": scene.background,
        "position": scene.position,
        "shape": scene.shape,
    }


def test_captions_round_trip_and_invalid_ones_are_refused():
    rng = random.Random(0)
    for _ in range(200):
        scene = world.sample_scene(rng, None)
        assert world.parse_caption(scene.caption()) == scene
    assert world.parse_caption("a large red circle at the top on a red background") is None
    assert world.parse_caption("a large red blob at the top on a blue background") is None
    assert world.parse_caption("red circle") is None


def test_held_out_combinations_never_appear_in_training_samples():
    rng = random.Random(1)
    train = [world.sample_scene(rng, False) for _ in range(2000)]
    held = [world.sample_scene(rng, True) for _ in range(200)]
    assert not any(s.held_out for s in train) and all(s.held_out for s in held)
    key = lambda s: (s.colour, s.shape, s.position, s.background)  # noqa: E731
    assert not {key(s) for s in train} & {key(s) for s in held}


def test_short_prompts_carry_their_attributes():
    assert world.short_prompt_attributes("small red circle top left on blue") == {
        "size": "small",
        "colour": "red",
        "shape": "circle",
        "position": "top left",
        "background": "blue",
    }
    rng = random.Random(2)
    for _ in range(200):
        scene = world.sample_scene(rng)
        attrs = world.short_prompt_attributes(world.short_prompt(scene, rng))
        assert all(getattr(scene, k) == v for k, v in attrs.items())
        assert {"colour", "shape"} <= set(attrs)


def test_checker_reads_ground_truth_renders():
    rng = random.Random(3)
    pairs = []
    for _ in range(400):
        scene = world.sample_scene(rng, None)
        pairs.append((_expected(scene), world.render(scene)))
    accuracy = checker.accuracy(pairs)
    assert all(v >= 0.99 for v in accuracy.values()), accuracy


def test_checker_reads_the_adapters_colour_and_shape_too():
    """The example adapters' pink and diamond (training/train_lora.py), among the base's."""
    rng = random.Random(5)
    pairs = []
    for i in range(400):
        scene = world.sample_scene(rng, None)
        if i % 2:
            colour = "pink" if scene.background != "pink" else scene.colour
            scene = dataclasses.replace(scene, colour=colour)
        if i % 3 == 0:
            scene = dataclasses.replace(scene, shape="diamond")
        pairs.append((_expected(scene), world.render(scene)))
    accuracy = checker.accuracy(pairs)
    assert all(v >= 0.99 for v in accuracy.values()), accuracy


def test_checker_is_near_chance_on_noise():
    rng = random.Random(4)
    noise = np.random.default_rng(4)
    pairs = [
        (
            _expected(world.sample_scene(rng, None)),
            noise.integers(0, 256, (64, 64, 3), dtype=np.uint8),
        )
        for _ in range(300)
    ]
    accuracy = checker.accuracy(pairs)
    # chance: 1/8 for colours, 1/9 for positions, 1/3 for shapes
    assert accuracy["colour"] < 0.25 and accuracy["background"] < 0.3
    assert accuracy["position"] < 0.25 and accuracy["shape"] < 0.5


def test_clips_move_in_their_direction():
    rng = random.Random(5)
    for _ in range(40):
        clip = world.sample_clip(rng)
        frames = world.render_clip(clip)
        assert frames.shape == (9, 64, 64, 3)
        assert checker.motion(frames) == clip.direction
    assert checker.motion(np.repeat(frames[:1], 9, axis=0)) is None  # no motion
