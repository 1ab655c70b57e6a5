"""What a request may ask of its model: engine params from a validated body, checked against the
server's limits and the model's own (models/limits.py) before anything is queued."""

from __future__ import annotations

import math
from dataclasses import replace

from vllm_omni_like.config import Limits
from vllm_omni_like.errors import InvalidRequestError
from vllm_omni_like.models.limits import OPENAI_VIDEO_SIZES, ModelLimits, check_expert_scales
from vllm_omni_like.params import DEFAULT_STRENGTH, GenerationParams
from vllm_omni_like.protocol.schemas import ImageRequest, VideoRequest, parse_size
from vllm_omni_like.wire import Mode

DEFAULT_SECONDS = 1.0


def check_prompt(prompt: str, limits: Limits) -> None:
    if len(prompt) > limits.max_prompt_chars:
        raise InvalidRequestError(
            f"prompt is {len(prompt)} characters; at most {limits.max_prompt_chars}",
            param="prompt",
            code="prompt_too_long",
        )


def check_steps(params: GenerationParams, model: ModelLimits, name: str) -> None:
    steps = params.num_inference_steps
    if steps is not None and steps < model.min_steps:
        raise InvalidRequestError(
            f"num_inference_steps {steps} is under {name}'s minimum of {model.min_steps} (its "
            "schedule stretches to a terminal sigma: one step is undefined)",
            param="num_inference_steps",
            code="invalid_value",
        )
    if steps is not None and steps > model.max_steps:
        raise InvalidRequestError(
            f"num_inference_steps {steps} is over {name}'s limit of {model.max_steps} (max_steps)",
            param="num_inference_steps",
            code="invalid_value",
        )


def check_pixels(params: GenerationParams, model: ModelLimits, name: str) -> None:
    width = params.width or model.default_width
    height = params.height or model.default_height
    if params.n * width * height > model.max_pixels:
        raise InvalidRequestError(
            f"n x width x height = {params.n} x {width} x {height} is over {name}'s limit of "
            f"{model.max_pixels} pixels (max_pixels)",
            param="n",
            code="invalid_size",
        )


def image_params(
    body: ImageRequest, limits: Limits, model: ModelLimits, name: str
) -> GenerationParams:
    """Generations: a size the model cannot make is a 400 naming the limit."""
    check_prompt(body.prompt, limits)
    size = parse_size(body.size)
    if size is not None:
        model.check_size(name, *size)
    params = GenerationParams(
        width=size[0] if size else None,
        height=size[1] if size else None,
        n=body.n,
        num_inference_steps=body.num_inference_steps,
        guidance_scale=body.guidance_scale,
        negative_prompt=body.negative_prompt,
        seed=body.seed,
        strength=body.strength,
        partial_images=body.partial_images if body.stream else 0,
        scheduler=body.scheduler,
        cache_threshold=body.cache_threshold(),
    )
    check_steps(params, model, name)
    model.check_scheduler(name, params.scheduler)
    check_pixels(params, model, name)
    return params


def fit_upload(width: int, height: int, model: ModelLimits, n: int = 1) -> tuple[int, int]:
    """An edit's size from its upload: scaled down (aspect kept) until it fits the model's side
    and pixel limits, rounded to the model's multiple."""
    scale = min(1.0, model.max_side / max(width, height))
    scale = min(scale, math.sqrt(model.max_pixels / (n * width * height)))
    m = model.size_multiple
    return (max(m, int(width * scale) // m * m), max(m, int(height * scale) // m * m))


def edit_params(
    body: ImageRequest, limits: Limits, model: ModelLimits, name: str, upload: tuple[int, int]
) -> GenerationParams:
    """Edits: without a size, the upload's own, fitted to the model; strength x steps runs at
    least one denoising step (diffusers runs int(steps x strength) of them)."""
    params = image_params(body, limits, model, name)
    if params.width is None:
        width, height = fit_upload(*upload, model, params.n)
        params = replace(params, width=width, height=height)
    if not model.edit_strength:  # an instruction edit: the image conditions every step
        if params.strength is not None:
            raise InvalidRequestError(
                f"{name} edits by instruction and takes no strength",
                param="strength",
                code="invalid_value",
            )
        check_pixels(params, model, name)
        return params
    strength = params.strength if params.strength is not None else DEFAULT_STRENGTH
    steps = params.num_inference_steps or model.default_steps
    if int(steps * strength) < 1:
        needed = math.ceil(1 / strength)
        while int(needed * strength) < 1:  # float rounding of steps x strength
            needed += 1
        if needed > model.max_steps:
            raise InvalidRequestError(
                f"strength {strength:g} runs no denoising step within {name}'s limit of "
                f"{model.max_steps} steps (int(num_inference_steps x strength) must be >= 1): "
                f"use a strength of at least {1 / model.max_steps:g}",
                param="strength",
                code="invalid_value",
            )
        params = replace(params, num_inference_steps=needed)
    check_pixels(params, model, name)
    return params


def video_size(body: VideoRequest, model: ModelLimits, name: str) -> tuple[int, int]:
    """The size made: OpenAI's standard sizes at the model's nearest supported size; any other
    size the model cannot make is a 400 naming what it can."""
    size = parse_size(body.size)
    if size is None:
        return model.default_width, model.default_height
    if body.size in OPENAI_VIDEO_SIZES and not model.supports(*size):
        return model.nearest_size(*size)
    model.check_size(name, *size)
    return size


def image_inputs(model: ModelLimits, name: str, upload: bool, mask: bool) -> None:
    """What an image model takes beside the prompt, by the modes it runs (`/v1/models`:
    limits.modes, the rule its stage refuses by): a model without text to image (an edit model,
    an inpainting UNet) needs an upload; one that inpaints only, a mask with it."""
    inpaints_only = Mode.INPAINT in model.modes and Mode.EDIT not in model.modes
    if not upload and model.needs_image:
        what = "inpaints an input image: send it one with a mask" if inpaints_only else ""
        raise InvalidRequestError(
            f"{name} {what or 'edits an input image: send it one'} through /v1/images/edits",
            param="model",
            code="image_required",
        )
    if upload and not mask and inpaints_only:
        raise InvalidRequestError(
            f"{name} inpaints only: send a mask with the image", param="mask", code="mask_required"
        )


def video_image(model: ModelLimits, name: str, upload: tuple[int, int] | None) -> None:
    """An image-to-video model needs `input_reference`; a text-to-video one takes none."""
    if upload is None and model.needs_image:
        raise InvalidRequestError(
            f"{name} makes a video from an image: send one as input_reference "
            "(a PNG, JPEG or WebP file, multipart/form-data)",
            param="input_reference",
            code="image_required",
        )
    if upload is not None and not model.image_to_video:
        raise InvalidRequestError(
            f"{name} makes videos from text only and takes no input_reference; "
            "an image-to-video model does (/v1/models: limits.image_to_video)",
            param="input_reference",
            code="invalid_value",
        )


def fit_area(width: int, height: int, model: ModelLimits) -> tuple[int, int]:
    """A video's size from its first frame's: the image's aspect at the model's default
    pixel count (its default size's area), within its side limit, rounded to its multiple."""
    scale = math.sqrt(model.default_width * model.default_height / (width * height))
    scale = min(scale, model.max_side / max(width, height))
    m = model.size_multiple
    return (max(m, round(width * scale / m) * m), max(m, round(height * scale / m) * m))


def video_params(
    body: VideoRequest,
    limits: Limits,
    model: ModelLimits,
    name: str,
    upload: tuple[int, int] | None = None,
) -> GenerationParams:
    """`upload`: the input_reference's (width, height): without a size, the video takes the
    image's aspect (`fit_area`)."""
    check_prompt(body.prompt, limits)
    video_image(model, name, upload)
    if upload is not None and parse_size(body.size) is None:  # (no size, or "auto")
        width, height = fit_area(*upload, model)
    else:
        width, height = video_size(body, model, name)
    fps = body.fps or model.default_fps or 8
    asked = body.num_frames or max(1, round(float(body.seconds or DEFAULT_SECONDS) * fps))
    frames = model.frames_for(asked)
    if model.max_frames is not None and frames > model.max_frames:
        longest = (model.max_frames - 1) / fps
        via = f"{float(body.seconds or DEFAULT_SECONDS):g} s x {fps} fps"
        if body.num_frames:
            via = f"num_frames {body.num_frames}"
        raise InvalidRequestError(
            f"{via} needs {frames} frames, over {name}'s limit of {model.max_frames} frames "
            f"(max_frames): at {fps} fps at most {longest:g} seconds",
            param="num_frames" if body.num_frames else "seconds",
            code="invalid_value",
        )
    params = GenerationParams(
        width=width,
        height=height,
        num_inference_steps=body.num_inference_steps,
        guidance_scale=body.guidance_scale,
        **body.family_params(),
        negative_prompt=body.negative_prompt,
        seed=body.seed,
        fps=fps,
        num_frames=frames,
        scheduler=body.scheduler,
        cache_threshold=body.cache_threshold(),
    )
    check_steps(params, model, name)
    model.check_scheduler(name, params.scheduler)
    check_expert_scales(params, model.experts, name)
    return params
