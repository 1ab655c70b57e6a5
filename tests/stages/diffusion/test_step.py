"""Our own denoising loop (stages/diffusion/step.py) on the embedded tiny models, CPU fp32: each
scheduler steps the latents the diffusers pipeline steps at the same seed, and a request's
output is the same alone or in a batch of other step counts, guidance scales, schedulers and
seeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.models.tiny_sdxl import tiny_sdxl_path
from vllm_omni_like.config import StageConfig
from vllm_omni_like.errors import InvalidRequestError
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.diffusion.row_tensors import text_dtype
from vllm_omni_like.stages.diffusion.rows import DenoiseSet
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.wire import StageRequest

pytestmark = pytest.mark.slow
STEPS, SEED, FRAMES = 5, 7, 5


def _stage(model: str, **config) -> DiffusionStage:
    stage = DiffusionStage(
        StageConfig(name="diffusion", kind="diffusion", model=model, dtype="float32", **config)
    )
    stage.load("cpu")
    return stage


@pytest.fixture(scope="module")
def image():
    stage = _stage("tiny-image")
    yield stage
    stage.close()


@pytest.fixture(scope="module")
def sdxl():
    stage = _stage(tiny_sdxl_path())
    yield stage
    stage.close()


@pytest.fixture(scope="module")
def video():
    stage = _stage("tiny-video", batched_cfg=False)  # (the pipeline calls once per branch)
    yield stage
    stage.close()


def _control(progress=None) -> StageControl:
    return StageControl(FaultInjector((), "diffusion"), progress)


def _request(stage: DiffusionStage, rid: str = "a", prompt: str = "a red cat", **params):
    mode = "text2video" if stage.runtime.is_video else "text2img"
    if stage.runtime.is_video:
        params.setdefault("num_frames", FRAMES)
    return StageRequest(rid, prompt, GenerationParams(**params), mode=mode)


def _our_latents(stage: DiffusionStage, request: StageRequest) -> list[torch.Tensor]:
    """The latents after each step of our loop."""
    rt = stage.runtime
    frames = FRAMES if rt.is_video else 1
    seen = []
    with torch.inference_mode():
        rows, embeds = rt.denoise.rows([request], rt.settings())
        shape = rt.adapter.latent_shape(1, rt.defaults.width, rt.defaults.height, frames)
        dtype = rt.adapter.latent_dtype(text_dtype(embeds))
        latents = rt.denoise.noise(rows, shape, dtype)
        rowset = DenoiseSet(rt.denoise)  # a set nothing joins: a whole batch
        rowset.join(rows, embeds, latents)
        while rowset.step({request.request_id}):
            assert rowset.latents is not None
            seen.append(rowset.latents.clone())
    return seen


def _pipeline_latents(stage: DiffusionStage, request: StageRequest) -> list[torch.Tensor]:
    """The latents after each step of the diffusers pipeline's own call."""
    rt, p = stage.runtime, request.params
    pipe = rt.pipe
    chosen = rt.adapter.scheduler(p.scheduler)
    pipe.scheduler = type(chosen).from_config(chosen.config)  # a fresh one, as a user builds it
    seen = []

    def record(pipe, i, t, kwargs):
        seen.append(kwargs["latents"].clone())
        return kwargs

    kwargs = rt.adapter.text_kwargs([request.prompt], [p.negative_prompt or ""], rt.text.tokenizer)
    # (none given: the pipeline's own default)
    kwargs["negative_prompt"] = None if p.negative_prompt is None else [p.negative_prompt]
    kwargs.update(
        num_inference_steps=p.num_inference_steps,
        guidance_scale=p.guidance_scale,
        generator=[torch.Generator().manual_seed(p.seed)],
        output_type="latent",
        callback_on_step_end=record,
        width=rt.defaults.width,
        height=rt.defaults.height,
    )
    if rt.is_video:
        kwargs["num_frames"] = FRAMES
    with torch.inference_mode():
        pipe(**kwargs)
    pipe.scheduler = rt.scheduler
    return seen


CASES = [
    ("image", name) for name in ("ddim", "pndm", "euler", "euler-a", "dpm++2m", "dpm++2m-karras")
] + [("image", "unipc"), ("image", None), ("video", "unipc"), ("video", "flow-euler")]
# (noise drawn at each step from the row's generator, three past outputs, a Runge-Kutta warm-up)
CASES += [("image", "dpm++2m-sde")]
CASES += [
    pytest.param("image", name, marks=pytest.mark.drill)
    for name in ("dpm++3m", "pndm-prk", "unipc-3")
]
CASES += [("sdxl", name) for name in (None, "euler-a", "dpm++2m-karras", "unipc")]
CASES += [pytest.param("sdxl", "dpm++2m-sde", marks=pytest.mark.drill)]


@pytest.mark.parametrize("guidance", [1.0, 4.0])
@pytest.mark.parametrize(("which", "scheduler"), CASES)
def test_each_scheduler_steps_the_latents_the_pipeline_steps(request, which, scheduler, guidance):
    stage = request.getfixturevalue(which)
    req = _request(
        stage,
        seed=SEED,
        num_inference_steps=STEPS,
        guidance_scale=guidance,
        scheduler=scheduler,
        negative_prompt=None if which == "sdxl" else "blurry",  # (SDXL's: zeros)
    )
    ours, theirs = _our_latents(stage, req), _pipeline_latents(stage, req)
    assert len(ours) == len(theirs) >= STEPS  # (PNDM makes one more call than its steps)
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert (a - b).abs().max().item() <= 1e-5, (scheduler, guidance, step)


def test_both_branches_in_one_forward_stay_within_rounding_of_two_calls(image):
    video = _stage("tiny-video")  # batched CFG (the default): one forward for both branches
    try:
        req = _request(video, seed=SEED, num_inference_steps=STEPS, guidance_scale=4.0)
        ours, theirs = _our_latents(video, req), _pipeline_latents(video, req)
        worst = max((a - b).abs().max().item() for a, b in zip(ours, theirs, strict=True))
        assert 0 < worst <= 1e-4  # a batched matmul's rounding, not another computation
    finally:
        video.close()


def _pixels(out) -> np.ndarray:
    return out.video.frames if out.video is not None else np.stack([i.pixels for i in out.images])


def _run(stage: DiffusionStage, batch: list[StageRequest], control=None) -> dict:
    outs = stage.begin(batch, control or _control()).finish(batch)
    return {o.request_id: _pixels(o) for o in outs}


def _mixed(stage: DiffusionStage) -> list[StageRequest]:
    schedulers = stage.runtime.family.schedulers
    return [
        _request(stage, "a", "a red cat", seed=1, num_inference_steps=3),
        _request(stage, "b", "a blue dog", seed=2, num_inference_steps=6, guidance_scale=1.0),
        _request(
            stage, "c", "a green car", seed=3, num_inference_steps=4, scheduler=schedulers[-1]
        ),
        _request(
            stage,
            "d",
            "a red cat",
            seed=9,
            num_inference_steps=5,
            guidance_scale=2.5,
            negative_prompt="fog",
            scheduler=schedulers[0],
            **({} if stage.runtime.is_video else {"n": 2}),
        ),
    ]


@pytest.mark.parametrize("which", ["image", "sdxl", "video"])
def test_a_request_is_the_same_alone_or_among_other_steps_scales_schedulers_and_seeds(
    request, which
):
    stage = request.getfixturevalue(which)
    batch = _mixed(stage)
    together = _run(stage, batch)
    for r in batch:
        alone = _run(stage, [r])[r.request_id]
        assert alone.shape == together[r.request_id].shape
        diff = np.abs(alone.astype(int) - together[r.request_id].astype(int)).max()
        assert diff <= 1, (r.request_id, diff)


def test_rows_with_and_without_guidance_share_one_forward_padded_to_the_bucket(image):
    sizes = []
    hook = image.runtime.pipe.unet.register_forward_pre_hook(
        lambda module, args, kwargs: sizes.append(args[0].shape[0]), with_kwargs=True
    )
    batch = [
        _request(image, "a", seed=1, num_inference_steps=2),  # guidance: 2 model rows
        _request(image, "b", seed=2, num_inference_steps=2, guidance_scale=1.0),  # 1
        _request(image, "c", seed=3, num_inference_steps=2, n=2),  # 4
    ]
    try:
        want = _run(image, batch)
        assert sizes == [7, 7]  # one forward a step: 3 + 1 + ... each row once, CFG rows twice
        sizes.clear()
        image.runtime.denoise.buckets = (2, 4, 8)  # as a compiled stage's: 7 model rows pad to 8
        padded = _run(image, batch)
        assert sizes == [8, 8]
    finally:
        image.runtime.denoise.buckets = ()
        hook.remove()
    for rid in want:
        assert np.abs(want[rid].astype(int) - padded[rid].astype(int)).max() <= 1


def test_each_request_reports_its_own_steps_and_a_finished_row_leaves_the_forward(image):
    reports, sizes = [], []
    control = _control(lambda ids, step, total, previews, progress: reports.append(progress))
    hook = image.runtime.pipe.unet.register_forward_pre_hook(
        lambda module, args, kwargs: sizes.append(args[0].shape[0]), with_kwargs=True
    )
    batch = [
        _request(image, "short", seed=1, num_inference_steps=2, guidance_scale=1.0),
        _request(image, "long", seed=2, num_inference_steps=4, guidance_scale=1.0),
    ]
    try:
        _run(image, batch, control)
    finally:
        hook.remove()
    assert reports == [
        {"short": (1, 2), "long": (1, 4)},
        {"short": (2, 2), "long": (2, 4)},
        {"long": (3, 4)},
        {"long": (4, 4)},
    ]
    assert sizes == [2, 2, 1, 1]
    assert control.steps_run == {"short": 2, "long": 4}


def test_an_aborted_request_leaves_the_forward_and_its_peers_run_on(image):
    sizes = []
    hook = image.runtime.pipe.unet.register_forward_pre_hook(
        lambda module, args, kwargs: sizes.append(args[0].shape[0]), with_kwargs=True
    )
    batch = [
        _request(image, "stays", seed=1, num_inference_steps=4, guidance_scale=1.0),
        _request(image, "goes", seed=2, num_inference_steps=4, guidance_scale=1.0),
    ]
    control = _control(
        lambda ids, step, total, previews, progress: step == 2 and control.abort(["goes"])
    )
    try:
        out = _run(image, batch, control)
    finally:
        hook.remove()
    assert sizes == [2, 2, 1, 1]  # from the step after the abort, one row
    alone = _run(image, [batch[0]])["stays"]
    assert np.abs(out["stays"].astype(int) - alone.astype(int)).max() <= 1
    assert control.steps_after_abort(["goes"]) == {"goes": 0}


def test_a_scheduler_outside_the_family_is_refused_by_the_stage(image, video):
    with pytest.raises(InvalidRequestError) as exc:
        image.validate(_request(image, scheduler="flow-euler"))
    assert exc.value.param == "scheduler"
    assert str(exc.value).startswith("scheduler 'flow-euler' is not one tiny-image runs")
    video.validate(_request(video, scheduler="flow-euler"))  # (taken)


def test_an_edit_on_the_pipelines_call_runs_with_the_scheduler_asked(image, monkeypatch):
    monkeypatch.setattr(image.runtime, "own", set())  # (as a CFG-parallel rank runs it)
    base = np.full((64, 64, 3), 200, dtype=np.uint8)
    mask = np.zeros((64, 64), dtype=np.uint8)
    mask[16:48, 16:48] = 255

    def edit(scheduler):
        params = GenerationParams(seed=5, num_inference_steps=4, strength=0.8, scheduler=scheduler)
        request = StageRequest("e", "a blue square", params, mode="edit", images=[base], mask=mask)
        pipe = image.runtime.edit_pipes["inpaint"]
        return _run(image, [request])["e"], type(pipe.scheduler).__name__

    default, used = edit(None)
    assert used == "DDIMScheduler"  # the model's own
    euler, used = edit("euler")
    assert used == "EulerDiscreteScheduler"
    assert np.abs(euler.astype(int) - default.astype(int)).max() > 1  # another computation
    again, used = edit(None)
    assert used == "DDIMScheduler" and np.array_equal(again, default)  # and back


def test_the_warm_up_runs_the_path_an_image_request_runs(image, monkeypatch):
    """A compiled stage's warm-up asks for what a request for a PNG asks (its rows filtered on
    the device after the decode), with and without guidance: nothing a request runs is new."""
    own = image.own_loop
    seen: list[StageRequest] = []
    begin = own.begin

    def recorded(batch, control):
        seen.extend(batch)
        return begin(batch, control)

    monkeypatch.setattr(own, "begin", recorded)
    ran = own.warm_up(1, 64, 64)
    assert ran == len(seen) and len({r.params.guidance_scale for r in seen}) >= 2  # (a row each)
    assert seen and all(r.encodes_png for r in seen)
