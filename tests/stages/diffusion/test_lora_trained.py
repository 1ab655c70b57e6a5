"""The example adapters (examples/loras: `pink` teaches tiny-image a colour the base never
learnt, `diamond` a shape; training/train_lora.py) do what they were trained for, through the
stage, CPU fp32: the shapes checker reads each adapter's word on its rows and not on the base's,
one batch mixing both adapters and the base gives each row its solo image (<= 1 level), scale 0
is the base, and a row equals diffusers' `load_lora_weights` + `fuse_lora` at the same seed."""

from __future__ import annotations

import dataclasses
import pathlib
import random

import numpy as np
import pytest

from tests.stages.diffusion.lora_helpers import (
    load_lora_stage,
    pipeline_image,
    psnr,
    run_images,
    tiny_image_pipe,
)
from vllm_omni_like.params import GenerationParams, LoraRef
from vllm_omni_like.shapes import checker, world
from vllm_omni_like.wire import StageRequest

pytestmark = pytest.mark.slow
EXAMPLES = pathlib.Path(__file__).resolve().parents[3] / "examples" / "loras"
ADAPTERS = {"pink": "colour", "diamond": "shape"}
ROWS = 6  # prompts with each adapter's word
READ_AT_LEAST = 4  # of ROWS, read as the word with its adapter (none without it)


def _captions(name: str) -> list[str]:
    """ROWS captions of the world with the adapter's word (seeded: the same every run)."""
    rng = random.Random(7)
    field = ADAPTERS[name]
    return [
        dataclasses.replace(world.sample_scene(rng), **{field: name}).caption() for _ in range(ROWS)
    ]


def _request(rid: str, caption: str, seed: int, loras=()) -> StageRequest:
    params = GenerationParams(seed=seed, loras=tuple(loras))
    return StageRequest(rid, caption, params, mode="text2img")


@pytest.fixture(scope="module")
def trained_stage():
    loras = tuple(f"{n}={EXAMPLES / f'{n}.safetensors'}" for n in ADAPTERS)
    stage = load_lora_stage("tiny-image", loras, 8, max_loras=2)
    yield stage
    stage.close()


@pytest.fixture(scope="module")
def mixed(trained_stage):
    """One batch: each adapter's prompts with it and without it (the base)."""
    batch = [
        _request(f"{name}-{with_it}-{i}", caption, seed=100 + i, loras=loras)
        for name in ADAPTERS
        for with_it, loras in (("on", (LoraRef(name),)), ("off", ()))
        for i, caption in enumerate(_captions(name))
    ]
    return batch, run_images(trained_stage, batch)


def _reads(images: dict[str, np.ndarray], name: str, with_it: str) -> int:
    field = ADAPTERS[name]
    return sum(
        checker.read_image(images[f"{name}-{with_it}-{i}"][0].astype(np.uint8))[field] == name
        for i in range(ROWS)
    )


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_the_checker_reads_each_adapters_word_with_it_and_never_without(mixed, name):
    _, images = mixed
    assert _reads(images, name, "on") >= READ_AT_LEAST, name
    assert _reads(images, name, "off") == 0, name


def test_each_row_of_the_mixed_batch_is_its_solo_image(trained_stage, mixed):
    batch, together = mixed
    for r in batch[:: ROWS // 2]:  # (both adapters and the base, with and without the word)
        alone = run_images(trained_stage, [r])[r.request_id]
        assert np.abs(alone - together[r.request_id]).max() <= 1, r.request_id


def test_scale_zero_is_the_base(trained_stage):
    """Each alone (a row beside others may move a level: the test above), bit for bit."""
    caption = _captions("pink")[0]
    zero = run_images(trained_stage, [_request("z", caption, 100, (LoraRef("pink", 0.0),))])
    base = run_images(trained_stage, [_request("b", caption, 100)])
    pink = run_images(trained_stage, [_request("p", caption, 100, (LoraRef("pink"),))])
    assert np.array_equal(zero["z"], base["b"])
    assert np.abs(pink["p"] - base["b"]).max() > 50  # (and the adapter at 1 is not the base)


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_a_row_equals_diffusers_fused_adapter(trained_stage, mixed, name):
    _, images = mixed
    pipe = tiny_image_pipe()
    pipe.load_lora_weights(str(EXAMPLES / f"{name}.safetensors"))
    pipe.fuse_lora(lora_scale=1.0)
    steps = trained_stage.runtime.defaults.steps  # (the rows' own: they name none)
    theirs = pipeline_image(pipe, trained_stage, 100, _captions(name)[0], steps)
    assert psnr(images[f"{name}-on-0"][0], theirs) >= 35
