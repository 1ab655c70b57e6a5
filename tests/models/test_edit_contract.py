"""Edits on our own loop (#55): for every family that edits with a strength, the stage's
image-to-image edit (its rows start from the upload's latents, noised to the strength's first
step) and its inpainting edit (the unmasked region put back after each step) equal the family's
diffusers img2img and inpainting pipelines called with the same image and mask at the same seed,
for each kind of scheduler a row may pick (their tables from a step other than the first: a
multistep solver starts again from first order there)."""

from __future__ import annotations

import dataclasses
import inspect

import diffusers
import numpy as np
import pytest
import torch

from tests.models.test_family_contract import EDIT_IMAGE, SEED, Case, _pixels, _run, case_of
from vllm_omni_like.models.adapter import adapter_for
from vllm_omni_like.models.registry import family_of
from vllm_omni_like.models.row_schedulers import make_scheduler
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.torch_utils import tensor_to_uint8
from vllm_omni_like.wire import Mode, StageRequest

pytestmark = pytest.mark.slow

STEPS, STRENGTH = 5, 0.6
DRILL = pytest.mark.drill  # (the other scheduler kinds: `-m drill`)
CASES = [
    ("stable-diffusion", None),  # (its own: PNDM)
    ("stable-diffusion", "dpm++2m"),  # (a multistep solver restarting at first order)
    pytest.param("stable-diffusion", "unipc", marks=DRILL),
    ("stable-diffusion", "euler-a"),  # (an ancestral step: the generator's draws in order)
    pytest.param("stable-diffusion", "ddim", marks=DRILL),
    ("stable-diffusion-xl", None),
    ("stable-diffusion-3", None),
    ("flux", None),
    ("qwen-image", None),  # (its video VAE: one frame, normalised by its mean and spread)
    ("z-image", None),  # (float32 latents, its velocity negated)
]


@pytest.fixture(scope="module")
def stages():
    made: dict[str, object] = {}

    def stage_of(case: Case):
        if case.name not in made:
            made[case.name] = case.stage()
        return made[case.name]

    return stage_of


def edit_request(
    case: Case,
    scheduler: str | None,
    strength: float = STRENGTH,
    mask: np.ndarray | None = None,
    guidance: float | None = None,  # (None: the family's default)
) -> StageRequest:
    limits = case.limits()
    params = GenerationParams(
        guidance_scale=guidance,
        seed=SEED,
        num_inference_steps=STEPS,
        width=limits.default_width,
        height=limits.default_height,
        strength=strength,
        scheduler=scheduler,
    )
    return StageRequest("r", "a red circle", params, mode="edit", images=[EDIT_IMAGE], mask=mask)


def pipeline_edit(
    case: Case,
    scheduler: str | None,
    strength: float = STRENGTH,
    mask: np.ndarray | None = None,
    guidance: float | None = None,
) -> np.ndarray:
    """The family's img2img (with a `mask`: inpainting) pipeline's call with the upload (and
    mask) resized to the output, as a user of diffusers makes it; its latents decoded by the
    adapter (SD3's inpainting pipeline decodes without the VAE's shift: that is its own)."""
    from PIL import Image

    pipe = case.pipeline()
    adapter = adapter_for(pipe, family_of(case.path))
    auto = (
        diffusers.AutoPipelineForImage2Image
        if mask is None
        else diffusers.AutoPipelineForInpainting
    )
    edit = auto.from_pipe(pipe)
    if scheduler is not None:
        edit.scheduler = make_scheduler(scheduler, dict(pipe.scheduler.config))
    limits = case.limits()
    size = (limits.default_width, limits.default_height)
    kwargs = dict(
        image=[Image.fromarray(EDIT_IMAGE).convert("RGB").resize(size)],
        strength=strength,
        num_inference_steps=STEPS,
        generator=[torch.Generator().manual_seed(SEED)],
        output_type="latent",
        **adapter.text_kwargs(["a red circle"], [""], getattr(pipe, "tokenizer", None)),
        **adapter.guidance_kwargs(_or(guidance, family_of(case.path).default_guidance)),
    )
    if "width" in inspect.signature(edit.__call__).parameters:  # (SD's takes the image's)
        kwargs.update(width=size[0], height=size[1])
    if mask is not None:
        kwargs["mask_image"] = [Image.fromarray(mask).convert("L").resize(size)]
    with torch.inference_mode():
        latents = adapter.loop_latents(edit(**kwargs).images, *size)
        return tensor_to_uint8(adapter.decoder(pipe)(latents))[0]


@pytest.mark.parametrize(("name", "scheduler"), CASES)
def test_an_image_to_image_edit_on_our_loop_is_the_img2img_pipelines(stages, name, scheduler):
    case = case_of(name)
    stage = stages(case)
    assert stage.runtime.loops[Mode.EDIT] == ("own", None)
    got = _run(stage, edit_request(case, scheduler))
    want = pipeline_edit(case, scheduler)
    assert got.shape == want.shape
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1


@pytest.mark.parametrize("strength", [1.0, 0.25])
def test_the_strength_picks_the_steps_the_pipeline_runs(stages, strength):
    """A whole-strength edit starts from noise at the first step; a small one runs
    int(5 x 0.25) = 1 step (FLUX.1's rule: from int(5 - 1.25) = 3 on, two steps)."""
    for name in ("stable-diffusion", "flux"):
        case = case_of(name)
        got = _run(stages(case), edit_request(case, None, strength))
        want = pipeline_edit(case, None, strength)
        assert np.abs(got.astype(int) - want.astype(int)).max() <= 1, name


# repaint a band of the upload (its own size: the stage resizes it with the image)
MASK = np.zeros(EDIT_IMAGE.shape[:2], np.uint8)
MASK[10:30, 20:60] = 255


@pytest.mark.parametrize(("name", "scheduler"), CASES)
def test_an_inpainting_edit_on_our_loop_is_the_inpainting_pipelines(stages, name, scheduler):
    case = case_of(name)
    stage = stages(case)
    assert stage.runtime.loops[Mode.INPAINT] == ("own", None)
    got = _run(stage, edit_request(case, scheduler, mask=MASK))
    want = pipeline_edit(case, scheduler, mask=MASK)
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1


def test_an_inpainting_edit_at_full_strength_starts_from_noise_alone(stages):
    """SD's inpainting pipeline starts a strength of 1 from its noise (scaled by its
    scheduler's initial sigma), not from the image noised to the first step."""
    for name in ("stable-diffusion", "flux"):
        case = case_of(name)
        got = _run(stages(case), edit_request(case, None, 1.0, MASK))
        want = pipeline_edit(case, None, 1.0, MASK)
        assert np.abs(got.astype(int) - want.astype(int)).max() <= 1, name


FLOW = ["qwen-image", "z-image"]  # (the families whose edits joined our own loop last)


def _request(case: Case, rid: str, strength: float, mask: np.ndarray | None = None):
    return dataclasses.replace(edit_request(case, None, strength, mask), request_id=rid)


@pytest.mark.parametrize("name", FLOW)
def test_an_image_to_image_row_joining_a_busy_text_set_is_the_img2img_pipelines(stages, name):
    """An img2img request joins a busy text-to-image set at its second step (one shape group:
    its rows step in the text rows' forward) and leaves it after: both make what their
    pipelines make at the same seed."""
    from tests.stages.diffusion.test_running_set import _Harness

    case = case_of(name)
    limits, text = case.limits(), case.request()  # (3 steps, at the size the edit names)
    size = {"width": limits.default_width, "height": limits.default_height}
    text = dataclasses.replace(text, params=dataclasses.replace(text.params, **size))
    h = _Harness(stages(case))
    h.add(1, text)
    h.steps(1)
    h.add(2, _request(case, "e", STRENGTH))  # (5 steps at 0.6: its last 3)
    assert [lane.batch_ids for lane in h.rows.lanes] == [[1, 2]]
    h.steps()
    want = _pixels(case, case.call(case.pipeline()))
    assert np.abs(h.pixels("r") - want.astype(int)).max() <= 1
    assert np.abs(h.pixels("e") - pipeline_edit(case, None).astype(int)).max() <= 1


@pytest.mark.parametrize("name", FLOW)
def test_an_inpainting_row_joining_a_busy_inpainting_set_is_the_inpainting_pipelines(stages, name):
    """An inpainting request at another strength joins a busy inpainting set at a later step
    (a shape group of its own: each step puts the unmasked region back): each request makes
    what its pipeline makes."""
    from tests.stages.diffusion.test_running_set import _Harness

    case = case_of(name)
    h = _Harness(stages(case))
    h.add(1, _request(case, "a", 1.0, MASK))  # (5 steps)
    h.steps(2)
    h.add(2, _request(case, "b", STRENGTH, MASK))  # (its last 3)
    assert [lane.batch_ids for lane in h.rows.lanes] == [[1, 2]]
    h.steps()
    for rid, strength in (("a", 1.0), ("b", STRENGTH)):
        want = pipeline_edit(case, None, strength, mask=MASK).astype(int)
        assert np.abs(h.pixels(rid) - want).max() <= 1, rid


@DRILL
@pytest.mark.parametrize("masked", [False, True])
def test_z_image_edits_with_guidance_are_its_pipelines(stages, masked):
    """Z-Image-Turbo runs without guidance by default; above 0 both branches run (the
    negative prompt's own tokens) in its img2img and inpainting edits as in its pipelines."""
    case, mask = case_of("z-image"), MASK if masked else None
    got = _run(stages(case), edit_request(case, None, mask=mask, guidance=2.5))
    want = pipeline_edit(case, None, mask=mask, guidance=2.5)
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1


def _or(value: float | None, default: float) -> float:
    return default if value is None else value
