"""What a model can be asked for: sizes, frames and steps, read from its own config files.

Torch-free, so the API process (admission, `/v1/models`) and the worker (its last check) use
the same numbers. A model's defaults come from what it was built or trained for; a stage's
`max_side` / `max_pixels` / `max_frames` / `max_steps` (CLI flags, YAML) override them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, TypedDict

from vllm_omni_like.config import PipelineConfig, StageConfig
from vllm_omni_like.cost import DEFAULT_STEPS
from vllm_omni_like.errors import ConfigError, InvalidRequestError
from vllm_omni_like.models.family import Family, Loop
from vllm_omni_like.models.precision import check_attention, check_quantization
from vllm_omni_like.models.registry import (
    FAMILIES,
    denoiser_config,
    family_for,
    family_of,
    loops_for,
    read_config,
)
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.wire import Mode

DEFAULT_MAX_STEPS = 200
DEFAULT_MAX_FRAMES = 129
DEFAULT_FPS = 8
NULL_MAX_SIDE = 2048
# sizes the OpenAI video API offers (the SDK's `size` choices): always answered, at the
# model's nearest supported size when it cannot make them as asked
OPENAI_VIDEO_SIZES = ("720x1280", "1280x720", "1024x1792", "1792x1024")


@dataclass(frozen=True)
class ModelLimits:
    """One pipeline's output model: what a request may ask of it."""

    output: str  # image | video | text
    max_side: int
    max_pixels: int  # n x width x height
    max_steps: int
    default_steps: int
    size_multiple: int  # width and height are multiples of this
    default_width: int
    default_height: int
    max_frames: int | None = None  # videos only
    default_frames: int | None = None
    frame_multiple: int | None = None  # frames are k x this + 1
    default_fps: int | None = None
    schedulers: tuple[str, ...] = ()  # the names a request's `scheduler` may take
    min_steps: int = 1  # 2 where one step is undefined (a schedule stretched to a terminal sigma)
    needs_image: bool = False  # it only edits (a generation without an image is refused)
    experts: int = 1  # denoisers switched by timestep (Wan2.2-A14B: 2, `guidance_scale_2`)
    edit_strength: bool = True  # its edits take a strength (False: edits by instruction)
    image_to_video: bool = False  # a video model that starts from an input image
    # the modes it runs (`Family.modes_of`): text2img, edit (an upload), inpaint (an upload and a
    # mask), text2video, image2video; a 9-channel inpainting UNet's: inpaint alone
    modes: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    def check_scheduler(self, model: str, scheduler: str | None) -> None:
        if scheduler is None or scheduler in self.schedulers:
            return
        runs = ", ".join(self.schedulers) or "none: only its own"
        raise InvalidRequestError(
            f"scheduler {scheduler!r} is not one {model} runs; it runs: {runs}",
            param="scheduler",
            code="invalid_value",
        )

    def sizes_text(self) -> str:
        m = self.size_multiple
        return f"width and height multiples of {m} from {m} to {self.max_side}"

    def supports(self, width: int, height: int) -> bool:
        m = self.size_multiple
        return all(m <= side <= self.max_side and side % m == 0 for side in (width, height))

    def check_size(self, model: str, width: int, height: int) -> None:
        if not self.supports(width, height):
            raise InvalidRequestError(
                f"size {width}x{height} is not supported by {model}: it makes "
                f"{self.sizes_text()} (max_side {self.max_side})",
                param="size",
                code="invalid_size",
            )

    def nearest_size(self, width: int, height: int) -> tuple[int, int]:
        """The supported size closest to WxH with its aspect ratio (scaled down to fit)."""
        scale = min(1.0, self.max_side / max(width, height))
        m = self.size_multiple

        def fit(side: float) -> int:
            return min(self.max_side, max(m, math.floor(side * scale / m + 0.5) * m))

        return fit(width), fit(height)

    def frames_for(self, frames: int) -> int:
        """Rounded up to what the model needs (k x frame_multiple + 1)."""
        k = -(-(max(1, frames) - 1) // (self.frame_multiple or 1))
        return k * (self.frame_multiple or 1) + 1


def check_expert_scales(
    params: GenerationParams, experts: int, model: str, stage: str | None = None
) -> None:
    """A low-noise expert's own scale (`guidance_scale_2`, Wan2.2-A14B's) for a model of one
    denoiser (`experts`: its count) is a 400 naming `model`: at admission an `invalid_value`;
    in a stage's validate (`stage`: its name) the stage's own error, as its other checks'."""
    if params.guidance_scale_2 is not None and experts < 2:
        raise InvalidRequestError(
            f"guidance_scale_2 is the low-noise expert's scale; {model} has one denoiser",
            param="guidance_scale_2",
            code="invalid_value" if stage is None else None,
            stage=stage,
        )


def model_path(stage: StageConfig) -> str:
    """The directory a diffusion stage loads (an embedded model's shipped copy, or the user's)."""
    from vllm_omni_like.models.tiny import TINY_NAMES, ensure_tiny_model  # (torch once built)

    name = stage.model or "tiny-image"
    return ensure_tiny_model(name) if name in TINY_NAMES else name


def stage_family(stage: StageConfig) -> Family | None:
    """The model family a stage runs (None: not a diffusion stage)."""
    return family_of(model_path(stage)) if stage.kind == "diffusion" else None


class StageFamily(TypedDict):
    """What `/health` and `/metrics` say of a diffusion stage's model (its keys are
    `/health`'s)."""

    family: str  # the family's name (models/)
    loop: Loop  # the loop its generation mode (its first) runs
    loops: dict[Mode, Loop]  # each mode's


def check_step_cache(stage: str, family: Family, cache: str) -> None:
    """Refuse `--cache first-block` for a family whose adapter has no block stack (the UNet
    families, Qwen-Image-Edit, a pipeline no family claims): a start-up error naming the flag."""
    if cache != "none" and not family.step_cache:
        runs = ", ".join(f.name for f in FAMILIES if f.step_cache)
        raise ConfigError(
            f"stage {stage!r}: --cache {cache} runs the transformer families ({runs}), not "
            f"{family.name}: serve it with --cache none"
        )


def describe_stage(stage: StageConfig) -> StageFamily | None:
    """A diffusion stage's family and the loop each of its modes runs (None: not diffusion)."""
    family = stage_family(stage)
    if family is None:
        return None
    check_quantization(stage.name, family, stage.quantization)  # (a start-up error)
    check_attention(stage.name, family, stage.attention)
    check_step_cache(stage.name, family, stage.cache)
    loops = loops_for(model_path(stage))
    return {
        "family": family.name,
        "loop": next(iter(loops.values()))[0],  # (its first mode's)
        "loops": {mode: loop for mode, (loop, _) in loops.items()},
    }


def _geometry(path: str) -> dict[str, Any]:
    """Spatial and temporal factors, native size and positional limits from the config files."""
    index = read_config(path, "model_index.json")
    net = denoiser_config(path, index)
    vae = read_config(path, "vae", "config.json")
    family = family_for(index, vae)
    spatial, temporal = family.vae_factors(vae)
    patch = net.get("patch_size") or 1
    patch_hw = int(patch[-1] if isinstance(patch, (list, tuple)) else patch)
    video = family.output == "video"
    base = family.size_base
    sample = net.get("sample_size")
    native = int(sample) * spatial if isinstance(sample, int) and not video else None
    if native is None and not video and isinstance(vae.get("sample_size"), int):
        native = int(vae["sample_size"])  # (a denoiser that does not say: FLUX.1's VAE does)
    native = native or family.native_side
    scheduler = read_config(path, "scheduler", "scheduler_config.json")
    rope = net.get("rope_max_seq_len")
    # SD3's learned positions: a grid of `pos_embed_max_size` patches a side at most
    grid = net.get("pos_embed_max_size")
    second = (index.get("transformer_2") or [None])[0] and index.get("boundary_ratio")
    return {
        "experts": 2 if second else 1,
        "family": family,
        "modes": family.modes_of(net, vae),
        "video": video,
        "multiple": math.lcm(base, spatial * patch_hw),
        "native": native,
        "temporal": temporal or 4,
        # rotary positions per axis bound the latent grid a transformer can place
        "side_cap": int(rope or grid or 0) * spatial * patch_hw or None,
        "frames_cap": (int(rope) - 1) * (temporal or 4) + 1 if rope else None,
        # FlowMatchEuler's stretch to `shift_terminal` divides by 1 - sigma: zero at one step
        "min_steps": 2 if scheduler.get("shift_terminal") else 1,
    }


def _first(*values: Any) -> Any:
    return next(v for v in values if v is not None)


def diffusion_limits(stage: StageConfig) -> ModelLimits:
    opts = stage.options
    path = model_path(stage)
    g = _geometry(path)
    video = g["video"]
    native = g["native"] or (64 if stage.model in ("", "tiny-image", "tiny-video") else 512)
    size = _first(opts.default_size, native)
    width = _first(opts.default_width, size)
    height = _first(opts.default_height, size)
    # a model draws well up to about twice what it was trained for; a transformer no further
    # than its rotary positions reach
    side = int(_first(stage.max_side, opts.max_side, 2 * max(width, height)))
    if g["side_cap"]:
        side = min(side, g["side_cap"])
    side -= side % g["multiple"]
    frames = fps = default_frames = None
    if video:
        cap = g["frames_cap"] or DEFAULT_MAX_FRAMES
        frames = min(int(_first(stage.max_frames, opts.max_frames, DEFAULT_MAX_FRAMES)), cap)
        default_frames = min(_first(opts.default_frames, 9), frames)
        fps = _first(opts.default_fps, DEFAULT_FPS)
    return ModelLimits(
        output="video" if video else "image",
        max_side=side,
        max_pixels=int(_first(stage.max_pixels, opts.max_pixels, 4 * side * side)),
        max_steps=int(_first(stage.max_steps, opts.max_steps, DEFAULT_MAX_STEPS)),
        default_steps=_first(opts.default_steps, DEFAULT_STEPS),
        size_multiple=g["multiple"],
        default_width=width,
        default_height=height,
        max_frames=frames,
        default_frames=default_frames,
        frame_multiple=g["temporal"] if video else None,
        default_fps=fps,
        schedulers=g["family"].schedulers,
        min_steps=g["min_steps"],
        # (no mode from text alone: an edit model, an image-to-video one, an inpainting UNet)
        needs_image=not {Mode.TEXT2IMG, Mode.TEXT2VIDEO} & set(g["modes"]),
        experts=g["experts"],
        edit_strength=g["family"].edit_strength,
        image_to_video=Mode.IMAGE2VIDEO in g["modes"],
        modes=tuple(str(m) for m in g["modes"]),
    )


def null_limits(stage: StageConfig) -> ModelLimits:
    output = stage.options.output
    side = int(_first(stage.max_side, stage.options.max_side, NULL_MAX_SIDE))
    video = output == "video"
    return ModelLimits(
        output=output,
        max_side=side,
        max_pixels=int(_first(stage.max_pixels, 16 * 1024 * 1024)),
        max_steps=int(_first(stage.max_steps, DEFAULT_MAX_STEPS)),
        default_steps=stage.options.steps,
        size_multiple=1,
        default_width=64,
        default_height=64,
        max_frames=int(_first(stage.max_frames, DEFAULT_MAX_FRAMES)) if video else None,
        default_frames=5 if video else None,
        frame_multiple=4 if video else None,
        default_fps=DEFAULT_FPS if video else None,
        modes=("text2video",) if video else ("text2img", "edit"),
    )


def stage_limits(stage: StageConfig) -> ModelLimits | None:
    """None for stages that make text or are users' own classes (no limits known)."""
    if stage.kind == "diffusion":
        return diffusion_limits(stage)
    if stage.kind == "null" and stage.options.output != "text":
        return null_limits(stage)
    return None


def pipeline_limits(pipeline: PipelineConfig) -> ModelLimits | None:
    """The limits of the stage that makes the pipeline's output (its last media stage)."""
    for stage in reversed(pipeline.stages):
        found = stage_limits(stage)
        if found is not None:
            return found
    return None
