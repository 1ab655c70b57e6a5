"""Inpainting checkpoints whose UNet takes 9 channels (SD1.5's and SDXL's inpainting models: the
latents, the mask, the masked image's latents) on our own loop (#55): an inpainting edit equals
StableDiffusion(XL)InpaintPipeline's call at the same seed (fp32, <= 1 level), from noise alone
and from a strength, and a row that joins a busy inpainting set at step k makes what it makes
alone."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from tests.models.model_dir import model_dir
from tests.models.test_edit_contract import MASK, edit_request, pipeline_edit
from tests.models.test_family_contract import Case, _run
from vllm_omni_like.wire import Mode

pytestmark = pytest.mark.slow


@functools.cache
def tiny_inpaint_path(xl: bool = False) -> str:
    """The tiny image model (or the tiny SDXL) with a 9-channel UNet, saved as its family's
    inpainting pipeline (random weights)."""
    import diffusers
    import torch

    from tests.models.tiny_sdxl import tiny_sdxl_path
    from vllm_omni_like.models.tiny import ensure_tiny_model

    source = tiny_sdxl_path() if xl else ensure_tiny_model("tiny-image")
    pipe = diffusers.DiffusionPipeline.from_pretrained(source, local_files_only=True)
    torch.manual_seed(1)
    unet = diffusers.UNet2DConditionModel.from_config({**pipe.unet.config, "in_channels": 9})
    cls = (
        diffusers.StableDiffusionXLInpaintPipeline
        if xl
        else diffusers.StableDiffusionInpaintPipeline
    )
    inpaint = cls(**{**pipe.components, "unet": unet})
    path = model_dir("tiny-inpaint-xl" if xl else "tiny-inpaint")
    inpaint.save_pretrained(path)
    return path


def _case(xl: bool) -> Case:
    path = tiny_inpaint_path(xl)
    return Case("sdxl-inpaint" if xl else "sd-inpaint", path, path, video=False, edit=False)


@pytest.fixture(scope="module")
def stage():
    s = _case(False).stage()
    yield s
    s.close()


@pytest.mark.parametrize(
    ("strength", "scheduler"),
    [(1.0, None), pytest.param(0.6, "euler-a", marks=pytest.mark.drill)],  # (noise alone; a
)  # strength: the image's latents drawn first, then the noise, then the masked image's)
def test_a_9_channel_inpainting_edit_on_our_loop_is_the_inpainting_pipelines(
    stage, strength, scheduler
):
    case = _case(False)
    assert stage.runtime.adapter.takes_mask()
    assert stage.runtime.loops[Mode.INPAINT] == ("own", None)
    got = _run(stage, edit_request(case, scheduler, strength, MASK))
    want = pipeline_edit(case, scheduler, strength, MASK)
    assert got.shape == want.shape
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1


def test_a_9_channel_inpainting_row_joins_a_busy_set_and_makes_what_it_makes_alone(stage):
    from tests.stages.diffusion.test_running_set import _alone, _Harness

    case = _case(False)
    first = edit_request(case, "dpm++2m", 0.75, MASK)
    params = dataclasses.replace(first.params, seed=9, num_inference_steps=6, strength=1.0)
    later = dataclasses.replace(first, request_id="b", params=params)
    alone = {r.request_id: _alone(stage, r) for r in (first, later)}
    h = _Harness(stage)
    h.add(1, first)
    h.steps(2)
    h.add(2, later)
    assert [lane.batch_ids for lane in h.rows.lanes] == [[1, 2]]
    h.steps()
    for rid, image in alone.items():
        assert np.abs(h.pixels(rid) - image).max() <= 1, rid


@pytest.mark.drill
def test_a_9_channel_sdxl_inpainting_edit_is_the_sdxl_inpainting_pipelines():
    case = _case(True)
    s = case.stage()
    try:
        assert s.runtime.adapter.takes_mask()
        got = _run(s, edit_request(case, None, 0.6, MASK))
    finally:
        s.close()
    want = pipeline_edit(case, None, 0.6, MASK)
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1


def test_a_9_channel_model_refuses_what_it_cannot_run_with_a_400_that_says_why(stage):
    """Neither pipeline runs text to image or img2img on a 9-channel UNet: refused before any
    row is made."""
    from vllm_omni_like.errors import InvalidRequestError
    from vllm_omni_like.params import GenerationParams
    from vllm_omni_like.wire import StageRequest

    case = _case(False)
    inpaint = edit_request(case, None, 1.0, MASK)
    stage.validate(inpaint)  # (taken)
    for request in (
        StageRequest("t", "a red circle", GenerationParams(seed=1), mode="text2img"),
        dataclasses.replace(inpaint, mask=None),  # (img2img)
    ):
        with pytest.raises(InvalidRequestError) as exc:
            stage.validate(request)
        want = "stage 'diffusion': this model's UNet inpaints only: send an image and a mask"
        assert str(exc.value) == want
