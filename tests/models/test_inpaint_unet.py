"""Inpainting checkpoints whose UNet takes 9 channels (SD1.5's and SDXL's inpainting models: the
latents, the mask, the masked image's latents) on our own loop (#55): an inpainting edit equals
StableDiffusion(XL)InpaintPipeline's call at the same seed (fp32, <= 1 level), from noise alone
and from a strength, and a row that joins a busy inpainting set at step k makes what it makes
alone; `/v1/models` lists inpainting as its only mode, and the server refuses the rest, at
admission (a 400 saying what to send) and in the stage (the same rule, `Family.takes_mask`)."""

from __future__ import annotations

import dataclasses
import functools
import time

import numpy as np
import pytest

from tests.models.model_dir import model_dir
from tests.models.test_edit_contract import MASK, edit_request, pipeline_edit
from tests.models.test_family_contract import EDIT_IMAGE, Case, _run
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
    # (the modes /v1/models shows: the stage's limits, its loops the same one mode)
    assert stage.runtime.limits.modes == ("inpaint",) and stage.runtime.limits.needs_image
    assert list(stage.runtime.loops) == [Mode.INPAINT]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tests.api.conftest import live_server

    with live_server(tmp_path_factory, tiny_inpaint_path()) as s:
        yield s


def _png(array: np.ndarray) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def test_v1_models_lists_inpainting_alone_and_the_server_refuses_the_rest(server):
    """/v1/models and /health say inpainting is all it runs; a generation and an edit without
    a mask are refused at admission with a 400 saying what to send (nothing queued: within
    2 s), and an inpainting edit runs."""
    with server.http() as http:
        (model,) = http.get("/v1/models").json()["data"]
        name = model["id"]
        assert model["limits"]["modes"] == ["inpaint"] and model["limits"]["needs_image"]
        (stage,) = http.get("/health").json()["stages"]
        assert (stage["loop"], stage["loops"]) == ("own", {"inpaint": "own"})
        image = ("image", ("a.png", _png(EDIT_IMAGE), "image/png"))
        mask = ("mask", ("m.png", _png(MASK), "image/png"))
        form = {"prompt": "a red circle", "model": name, "num_inference_steps": "2"}
        started = time.monotonic()
        text = {"prompt": "a red circle", "model": name}
        refused = [
            http.post("/v1/images/generations", json=text),
            http.post("/v1/images/edits", data=form, files=[image]),  # (no mask)
        ]
        assert time.monotonic() - started < 2.0  # (refused at admission: no stage ran)
        inpainted = http.post("/v1/images/edits", data=form, files=[image, mask])
    assert [(r.status_code, _error(r)) for r in refused] == [
        (
            400,
            (
                f"{name} inpaints an input image: send it one with a mask through /v1/images/edits",
                "model",
                "image_required",
            ),
        ),
        (400, (f"{name} inpaints only: send a mask with the image", "mask", "mask_required")),
    ]
    assert inpainted.status_code == 200, inpainted.text
    assert len(inpainted.json()["data"]) == 1


def _error(response) -> tuple[str, str, str]:
    err = response.json()["error"]
    assert err["type"] == "invalid_request_error"
    return err["message"], err["param"], err["code"]


@pytest.mark.drill  # (the UNet traced by dynamo at load)
def test_a_compiled_9_channel_stage_warms_up_by_inpainting_and_inpaints_as_the_plain_one(stage):
    """Compiled (dynamo's eager backend: real tracing, no C compiler), its warm-up at load runs
    its one mode, inpainting, from a blank upload and a mask of it all (text to image, the
    family's first mode, would feed the UNet 4 channels, not its 9); an inpainting edit then
    makes what the plain stage makes, within a level."""
    from tests.stages.diffusion.test_compiled import _compiled_stage

    compiled = _compiled_stage(1, (1,), model=tiny_inpaint_path(), warmup_sizes=("80x48",))
    try:
        request = edit_request(_case(False), None, 1.0, MASK)
        got = _run(compiled, request)
    finally:
        compiled.close()
    assert np.abs(got.astype(int) - _run(stage, request).astype(int)).max() <= 1
