"""The contract every registered model family keeps (models/<family>/adapter.py), run on its
embedded tiny model: the stage makes what its diffusers pipeline makes at the same seed, the
adapter decodes, shapes latents and calls the denoiser as the pipeline does, the limits are what
the pipeline accepts, and where the family has classifier-free guidance its CFG-parallel split
reproduces one rank. A new family registers a tiny model here (docs/architecture.md, "Adding a
model family")."""

from __future__ import annotations

import dataclasses
import os

import diffusers
import numpy as np
import pytest
import torch

from tests.models.tiny_mmdit import tiny_flux_path, tiny_sd3_path
from tests.models.tiny_qwen import tiny_qwen_image_edit_path, tiny_qwen_image_path
from tests.models.tiny_sdxl import tiny_sdxl_path
from tests.models.tiny_wan22 import tiny_wan21_i2v_path, tiny_wan22_ti2v_path
from tests.models.tiny_z_image import tiny_z_image_path
from tests.stages.cfg_probe import local_branches
from vllm_omni_like.config import StageConfig
from vllm_omni_like.models import registry
from vllm_omni_like.models.adapter import Guidance, adapter_for
from vllm_omni_like.models.limits import diffusion_limits
from vllm_omni_like.models.packing import pack, unpack
from vllm_omni_like.models.registry import FAMILIES, family_of
from vllm_omni_like.models.tiny import ensure_tiny_model
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.diffusion.edits import first_frame
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.stages.torch_utils import tensor_to_uint8
from vllm_omni_like.wire import StageRequest

pytestmark = pytest.mark.slow

# every registered family's tiny model (built offline: models/tiny.py; SDXL's, FLUX.1's and
# SD3's for the tests only: tests/models/tiny_sdxl.py, tiny_mmdit.py)
TINY = {
    "stable-diffusion": "tiny-image",
    "stable-diffusion-xl": tiny_sdxl_path,
    "stable-diffusion-3": tiny_sd3_path,
    "flux": tiny_flux_path,
    "qwen-image": tiny_qwen_image_path,
    "qwen-image-edit": tiny_qwen_image_edit_path,
    "z-image": tiny_z_image_path,
    "wan": "tiny-video",
    "wan-ti2v": tiny_wan22_ti2v_path,
    "wan-i2v": tiny_wan21_i2v_path,
}
# options of a tiny model whose family's native size is a real model's (Qwen-Image: 1024; a
# Wan directory not named as the embedded tiny model: 512)
OPTIONS = {
    name: {"default_size": 64} for name in ("qwen-image", "qwen-image-edit", "wan-ti2v", "wan-i2v")
}
SEED, STEPS, FRAMES = 3, 3, 5
# what an edit-only family edits: an upload of another size and aspect than the output's
EDIT_IMAGE = np.stack([*np.meshgrid(np.arange(80), np.arange(48)), np.full((48, 80), 90)], -1)
EDIT_IMAGE = (EDIT_IMAGE * 3 % 256).astype(np.uint8)


@dataclasses.dataclass
class Case:
    name: str
    model: str
    path: str
    video: bool
    edit: bool  # it only edits an image (its requests and calls carry EDIT_IMAGE)
    options: dict = dataclasses.field(default_factory=dict)  # the stage's (OPTIONS)

    def stage(self, **config) -> DiffusionStage:
        config = {"name": "diffusion", "kind": "diffusion", "model": self.model, **config}
        config.setdefault("options", self.options)
        stage = DiffusionStage(StageConfig(**config))
        stage.load("cpu")
        return stage

    def pipeline(self):
        pipe = diffusers.DiffusionPipeline.from_pretrained(
            self.path,
            local_files_only=True,
            dtype=torch.float32,  # the stage's on a CPU
            **family_of(self.path).adapter_class().own_components(self.path),
        )
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def limits(self):
        return diffusion_limits(
            StageConfig(name="d", kind="diffusion", model=self.model, options=self.options)
        )

    def call(self, pipe, **kw):
        """The pipeline's own call, as the stage asks it (prompt, size, seed, steps, guidance):
        its text and guidance arguments are the adapter's, as the stage's pipeline call makes
        them (T5's length; Qwen-Image's true CFG scale and negative prompt)."""
        limits = self.limits()
        adapter = adapter_for(pipe, family_of(self.path))
        kwargs = dict(
            width=limits.default_width,
            height=limits.default_height,
            num_inference_steps=STEPS,
            generator=[torch.Generator().manual_seed(SEED)],
            output_type="pt",
            **adapter.text_kwargs(["a red circle"], [""], getattr(pipe, "tokenizer", None)),
            **adapter.guidance_kwargs(family_of(self.path).default_guidance),
        )
        if self.video:
            kwargs["num_frames"] = FRAMES
        if self.edit and self.video:  # the first frame the stage fits to the size
            size = (kw.get("width", kwargs["width"]), kw.get("height", kwargs["height"]))
            kwargs["image"] = first_frame(self.request(), *size)
        elif self.edit:  # one image, as a user calls it (the pipeline fits only a single one)
            from PIL import Image

            kwargs["image"] = Image.fromarray(EDIT_IMAGE)
        kwargs.update(kw)
        with torch.inference_mode():
            return pipe(**kwargs)

    def image(self, width: int, height: int):
        """The image the stage conditions an edit's rows on (its runtime's `image_of`): the
        upload as sent, or an image-to-video request's first frame fitted to the size."""
        from PIL import Image

        if self.video:
            return first_frame(self.request(), width, height)
        return Image.fromarray(EDIT_IMAGE).convert("RGB")

    def request(self) -> StageRequest:
        params = GenerationParams(seed=SEED, num_inference_steps=STEPS)
        if self.video:
            params = dataclasses.replace(params, num_frames=FRAMES)
        if self.edit:  # (the output's size: the limits' default, as `call` asks)
            limits = self.limits()
            size = {"width": limits.default_width, "height": limits.default_height}
            params = dataclasses.replace(params, **size)
            mode = "image2video" if self.video else "edit"
            return StageRequest("r", "a red circle", params, mode=mode, images=[EDIT_IMAGE])
        mode = "text2video" if self.video else "text2img"
        return StageRequest("r", "a red circle", params, mode=mode)


def _model(entry) -> str:
    """An embedded model's name, or a test model's directory (built on first use)."""
    return entry() if callable(entry) else entry


@pytest.fixture(scope="module", params=sorted(TINY))
def case(request) -> Case:
    return case_of(request.param)


def case_of(name: str) -> Case:
    """The registered family `name`'s tiny model as a contract case (built on first use)."""
    model = _model(TINY[name])
    path = model if os.path.isdir(model) else ensure_tiny_model(model)
    family = family_of(path)
    options = OPTIONS.get(name, {})
    return Case(name, model, path, family.output == "video", family.needs_image, options)


def _run(stage: DiffusionStage, request: StageRequest) -> np.ndarray:
    (out,) = stage.execute([request], StageControl(FaultInjector((), "diffusion")))
    assert out.error is None, out.error
    return out.video.frames if out.video is not None else out.images[0].pixels


def _pixels(case: Case, result) -> np.ndarray:
    media = result.frames if case.video else result.images
    return tensor_to_uint8(media)[0]


def test_every_registered_family_has_a_tiny_model_here():
    assert {f.name for f in FAMILIES} == set(TINY)
    for name, model in TINY.items():
        model = _model(model)
        assert family_of(model if os.path.isdir(model) else ensure_tiny_model(model)).name == name


def test_the_stage_makes_what_its_diffusers_pipeline_makes(case):
    stage = case.stage()
    rt = stage.runtime
    assert rt.family.name == case.name and type(rt.adapter).family.name == case.name
    assert rt.loops[case.request().loop_mode] == ("own", None)  # (every family's mode)
    got = _run(stage, case.request())
    want = _pixels(case, case.call(case.pipeline()))
    assert got.shape == want.shape
    # batched CFG (Wan's two calls in one forward) rounds differently, nothing more
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1


def test_the_adapter_decodes_and_shapes_latents_as_the_pipeline_does(case):
    pipe = case.pipeline()
    adapter = adapter_for(pipe, family_of(case.path))
    latents = case.call(pipe, output_type="latent")
    latents = latents.frames if case.video else latents.images
    limits = case.limits()
    width, height = limits.default_width, limits.default_height
    latents = adapter.loop_latents(latents, width, height)  # (FLUX.1's: unpacked)
    assert tuple(latents.shape) == adapter.latent_shape(1, width, height, FRAMES)
    with torch.inference_mode():
        decoded = tensor_to_uint8(adapter.decoder(pipe)(latents))[0]
    assert np.array_equal(decoded, _pixels(case, case.call(pipe)))  # byte for byte


CALLS = {Guidance.BATCHED: 1, Guidance.TWO_CALLS: 2, Guidance.TRUE_CFG: 2, Guidance.DISTILLED: 1}


def test_the_adapter_calls_the_denoiser_as_the_pipeline_does(case):
    if case.edit:  # rows that carry their own conditioning from the image
        _check_conditioned_calls(case)
        return
    pipe = case.pipeline()
    adapter = adapter_for(pipe, family_of(case.path))
    (expert,) = adapter.experts()
    calls = []

    def record(module, args, kwargs, out):
        calls.append((args, kwargs, out[0]))

    handle = expert.model.register_forward_hook(record, with_kwargs=True)
    try:  # (two steps: one is degenerate where the schedule stretches to a terminal sigma)
        case.call(pipe, num_inference_steps=2, output_type="latent")
    finally:
        handle.remove()
    # one forward over both halves (SD, SD3) or with the guidance embedded (FLUX.1), or one per
    # branch (Wan, Qwen-Image's true CFG); the first step's
    guided = family_of(case.path).default_guidance > adapter.cfg_above
    want = CALLS[adapter.guidance] if guided else 1
    if isinstance(calls[0][0][0] if calls[0][0] else None, list):  # one list holds both
        want = 1  # branches (Z-Image)
    calls = calls[:want]
    assert len(calls) == want
    limits = case.limits()
    size = (limits.default_width, limits.default_height)
    timestep = pipe.scheduler.timesteps[0]  # (the first step's, as the scheduler has it)
    outs = []
    with torch.inference_mode():
        for args, kwargs, out in calls:
            if args and isinstance(args[0], list):  # Z-Image: lists of frames and texts
                latents, text, out = _listed(args, out)
                got = adapter.predict(latents, timestep.float().expand(len(args[0])), text)
                assert torch.allclose(got, out, atol=1e-6)
                outs.append(out)
                continue
            latents = args[0] if args else kwargs["hidden_states"]
            text = kwargs["encoder_hidden_states"]
            added = kwargs.get("added_cond_kwargs")
            if added:  # SDXL's pooled embedding (its size conditioning is the adapter's own)
                text = {"embeds": text, "pooled": added["text_embeds"]}
            if "pooled_projections" in kwargs:  # the MMDiTs'
                text = {"embeds": text, "pooled": kwargs["pooled_projections"]}
            if "encoder_hidden_states_mask" in kwargs:  # texts of their own lengths (Qwen)
                mask = kwargs["encoder_hidden_states_mask"]
                text = {
                    "embeds": text,
                    "mask": torch.ones(text.shape[:2]) if mask is None else mask,
                }
            latents, out = adapter.loop_latents(latents, *size), adapter.loop_latents(out, *size)
            per_row = timestep.float().reshape(1).expand(latents.shape[0]).cpu()
            got = adapter.predict(latents, per_row, text, guidance=kwargs.get("guidance"))
            assert torch.allclose(got, out, atol=1e-6)
            outs.append(out)
    assert set(adapter.schedulers()) >= {type(pipe.scheduler).__name__}
    if adapter.guidance is Guidance.DISTILLED or not guided:
        return
    uncond, cond = (outs[0].chunk(2)) if len(outs) == 1 else (outs[1], outs[0])
    want = uncond + 5.0 * (cond - uncond)
    if adapter.guidance is Guidance.TRUE_CFG:  # QwenImagePipeline's: each token's norm kept
        c, g = pack(cond), pack(want)
        ratio = torch.norm(c, dim=-1, keepdim=True) / torch.norm(g, dim=-1, keepdim=True)
        want = unpack(g * ratio, *cond.shape[-2:])
    assert torch.allclose(adapter.guide(cond, uncond, 5.0), want)


def _check_conditioned_calls(case: Case) -> None:
    """A family whose rows carry their own conditioning from an image: the adapter makes a
    row's conditioning as the pipeline makes it (`condition`, from the image the stage hands
    over) and calls the denoiser with it as the pipeline does (`predict_conditioned`), each
    call's inputs taken apart into the noise's latents and the row's conditioning."""
    pipe = case.pipeline()
    adapter = adapter_for(pipe, family_of(case.path))
    assert adapter.conditioned and registry.loops_for(case.path)[case.request().mode][0] == "own"
    (expert,) = adapter.experts()
    calls = []
    handle = expert.model.register_forward_hook(
        lambda module, args, kwargs, out: calls.append((kwargs, out[0])), with_kwargs=True
    )
    try:
        case.call(pipe, num_inference_steps=2, output_type="latent")
    finally:
        handle.remove()
    limits = case.limits()
    width, height = limits.default_width, limits.default_height
    shape = adapter.latent_shape(1, width, height, FRAMES)
    timestep = pipe.scheduler.timesteps[0]
    with torch.inference_mode():
        image = case.image(width, height)
        made = adapter.condition(image, shape, torch.float32, torch.device("cpu"))
        for kwargs, out in calls[:2]:  # (the first step's branches)
            latents, conditioning, text, out = _conditioned_inputs(case, shape, kwargs, out)
            assert made.keys() == conditioning.keys()
            for key, value in made.items():
                assert torch.equal(value.expand_as(conditioning[key]), conditioning[key]), key
            rows = latents.shape[0]
            per_row = timestep.float().reshape(1).expand(rows)
            got = adapter.predict_conditioned(latents, per_row, text, conditioning)
            assert torch.allclose(got, out, atol=1e-6)


def _conditioned_inputs(case: Case, shape: tuple, kwargs: dict, out: torch.Tensor) -> tuple:
    """A recorded call as our loop's model rows: (latents, conditioning, text, prediction)."""
    hidden = kwargs["hidden_states"]
    if case.name == "qwen-image-edit":  # the noise's tokens, then the upload's
        h, w = shape[-2:]
        noise = h // 2 * (w // 2)
        _, (_, ih, iw) = kwargs["img_shapes"][0]
        mask = kwargs["encoder_hidden_states_mask"]
        embeds = kwargs["encoder_hidden_states"]
        text = {"embeds": embeds, "mask": torch.ones(embeds.shape[:2]) if mask is None else mask}
        image = unpack(hidden[:, noise:], 2 * ih, 2 * iw)
        latents, out = unpack(hidden[:, :noise], h, w), unpack(out[:, :noise], h, w)
        return latents, {"image": image}, text, out  # (the pipeline keeps the noise's)
    channels = shape[1]  # Wan image to video: the noise's channels, then the condition's
    conditioning = {"condition": hidden[:, channels:]}
    if kwargs.get("encoder_hidden_states_image") is not None:  # (Wan2.1-I2V's CLIP features)
        conditioning["image_embeds"] = kwargs["encoder_hidden_states_image"]
    return hidden[:, :channels], conditioning, kwargs["encoder_hidden_states"], out


def _listed(args: tuple, out: list) -> tuple:
    """A list-input transformer's call (Z-Image's: each row's frame and text tokens) as our
    loop's rows: latents, texts padded with their counts, and the negated velocity."""
    frames, texts = args[0], args[2]
    lengths = [t.shape[0] for t in texts]
    longest = max(lengths)
    embeds = torch.stack(
        [torch.cat([t, t.new_zeros(longest - t.shape[0], t.shape[1])]) for t in texts]
    )
    text = {"embeds": embeds, "lengths": torch.tensor(lengths)}
    return torch.stack(frames).squeeze(2), text, -torch.stack([o.float() for o in out]).squeeze(2)


def test_the_limits_are_what_the_pipeline_accepts(case):
    limits = case.limits()
    family = family_of(case.path)
    assert limits.output == family.output
    pipe = case.pipeline()
    width = limits.default_width + limits.size_multiple
    assert limits.supports(width, limits.default_height)
    case.call(pipe, num_inference_steps=2, width=width, output_type="latent")  # accepted
    assert not limits.supports(width + 1, limits.default_height)
    if family.name in ("flux", "qwen-image", "qwen-image-edit"):  # they make it smaller instead
        out = case.call(pipe, num_inference_steps=2, width=width + 1)
        assert out.images.shape[-1] == width
    else:
        with pytest.raises(ValueError):  # what the limits refuse, the pipeline's check refuses
            case.call(pipe, num_inference_steps=2, width=width + 1)
    if case.video:
        assert limits.frame_multiple == pipe.vae_scale_factor_temporal


class LocalLeader:
    """Rank 1 of CFG-parallel in this process: its branch runs here, on the same model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.calls = model, 0

    def arm(self) -> None:
        pass

    def settle(self) -> None:
        pass

    def alongside(self, local, args: tuple, kwargs: dict):
        self.calls += 1
        return local(), self.model(*args, **kwargs)[0]


def test_the_cfg_parallel_split_of_a_pipeline_call_reproduces_one_rank(case):
    # one forward, or branches of two lengths: no split
    if case.name in ("flux", "qwen-image", "qwen-image-edit", "z-image"):
        with pytest.raises(ValueError, match="CFG-parallel does not run"):
            case.stage().runtime.adapter.split_cfg(LocalLeader(torch.nn.Identity()))
        return
    one_rank = _run(case.stage(), case.request())
    stage = case.stage(batched_cfg=False)
    stage.runtime.own = set()  # (a mode that runs the pipeline's call: the generic family's)
    model = getattr(stage.runtime.pipe, stage.runtime.adapter.denoiser_name)
    leader = LocalLeader(model)
    stage.runtime.cfg = stage.runtime.adapter.split_cfg(leader)
    split = _run(stage, case.request())
    assert leader.calls == STEPS  # one exchange a step
    assert np.abs(split.astype(int) - one_rank.astype(int)).max() <= 1


def test_our_loops_cfg_parallel_split_reproduces_one_rank(case):
    """Our own loop on CFG-parallel (rank 1's side in this process: `ServedBranches` over the
    same stage's loop): each step's unconditional forward goes to rank 1, once a step, and the
    output is one rank's (both branches in one forward) - each family's guidance (SD's CFG,
    Qwen-Image's rescaled true CFG, Z-Image's, Wan's) applied on rank 0 alike."""
    request = case.request()
    request = dataclasses.replace(
        request, params=dataclasses.replace(request.params, guidance_scale=4.0)
    )
    stage = case.stage(batched_cfg=False)
    rt = stage.runtime
    if rt.adapter.guidance in (Guidance.DISTILLED, Guidance.NONE):  # (FLUX.1: no branches)
        return
    leader = local_branches(stage)
    split = _run(stage, request)
    assert leader.calls == STEPS  # one exchange a step
    one_rank = _run(case.stage(), request)
    assert np.abs(split.astype(int) - one_rank.astype(int)).max() <= 1
