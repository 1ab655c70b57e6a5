"""Request and response schemas of the HTTP API (and of the offline batch lines)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from vllm_omni_like import config
from vllm_omni_like.config import Limits
from vllm_omni_like.errors import InvalidRequestError
from vllm_omni_like.params import GenerationParams

# Known OpenAI fields that do not apply to these models: accepted and ignored (README lists them).
IGNORED_OPENAI_FIELDS = (
    "quality",
    "style",
    "background",
    "moderation",
    "safety_identifier",
    "complexity",
    "input_fidelity",
    "frame_count",
    "frame_duration_ms",
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Sampling(_Strict):
    """The extensions every generation route takes (sent through the SDK's `extra_body`)."""

    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(default=None, ge=1)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=100.0)
    seed: int | None = Field(default=None, ge=0, lt=2**31)
    user: str | None = None
    quality: Any = None
    style: Any = None
    background: Any = None
    moderation: Any = None
    safety_identifier: Any = None
    complexity: Any = None
    input_fidelity: Any = None
    frame_count: Any = None
    frame_duration_ms: Any = None


class ImageRequest(_Sampling):
    prompt: str = Field(min_length=1)
    model: str | None = None
    n: int = Field(default=1, ge=1, le=10)
    size: str = "auto"
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: Literal["png", "jpeg", "webp"] = "png"
    output_compression: int | None = Field(default=None, ge=0, le=100)
    stream: bool = False
    partial_images: int = Field(default=0, ge=0, le=3)
    strength: float | None = Field(default=None, gt=0.0, le=1.0)  # edits

    @field_validator("size")
    @classmethod
    def _size_shape(cls, v: str) -> str:
        parse_size(v)
        return v


class VideoRequest(_Sampling):
    prompt: str = Field(min_length=1)
    model: str | None = None
    seconds: str | None = None
    size: str = "auto"
    fps: int | None = Field(default=None, ge=1, le=60)
    num_frames: int | None = Field(default=None, ge=1)

    @field_validator("size")
    @classmethod
    def _size_shape(cls, v: str) -> str:
        parse_size(v)
        return v

    @field_validator("seconds")
    @classmethod
    def _seconds(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                ok = 0 < float(v) <= 60
            except ValueError:
                ok = False
            if not ok:
                raise ValueError("seconds must be a number of seconds within (0, 60]")
        return v


def parse_size(size: str) -> tuple[int, int] | None:
    """'WxH' -> (width, height); 'auto' -> None (the model's native size)."""
    if size == "auto":
        return None
    try:
        return config.parse_size(size)
    except ValueError:
        raise ValueError(f"size must be 'WIDTHxHEIGHT' or 'auto', not {size!r}") from None


def check_limits(params: GenerationParams, limits: Limits, prompt: str) -> None:
    """API.md's limits, checked before anything reaches the engine."""
    if len(prompt) > limits.max_prompt_chars:
        raise InvalidRequestError(
            f"prompt is {len(prompt)} characters; at most {limits.max_prompt_chars}",
            param="prompt",
            code="prompt_too_long",
        )
    if params.num_inference_steps is not None and params.num_inference_steps > limits.max_steps:
        raise InvalidRequestError(
            f"num_inference_steps must be at most {limits.max_steps}", param="num_inference_steps"
        )
    if params.width is not None and params.height is not None:
        for side in (params.width, params.height):
            if side > limits.max_side:
                raise InvalidRequestError(
                    f"size {params.width}x{params.height} is over the "
                    f"maximum side of {limits.max_side}",
                    param="size",
                    code="invalid_size",
                )
        if params.n * params.width * params.height > limits.max_pixels:
            raise InvalidRequestError(
                f"n x width x height is over the pixel budget of {limits.max_pixels}",
                param="n",
                code="invalid_size",
            )
    if params.num_frames is not None and params.num_frames > limits.max_frames:
        raise InvalidRequestError(f"at most {limits.max_frames} frames", param="num_frames")


def image_params(body: ImageRequest, limits: Limits) -> GenerationParams:
    size = parse_size(body.size)
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
    )
    check_limits(params, limits, body.prompt)
    return params


DEFAULT_FPS = 8
DEFAULT_SECONDS = 1.0


def video_frames(body: VideoRequest, temporal_multiple: int = 4) -> int:
    """num_frames wins over seconds x fps; rounded up to k * multiple + 1 (what Wan needs)."""
    fps = body.fps or DEFAULT_FPS
    frames = body.num_frames or max(1, round(float(body.seconds or DEFAULT_SECONDS) * fps))
    k = -(-(frames - 1) // temporal_multiple)
    return k * temporal_multiple + 1


def video_params(body: VideoRequest, limits: Limits) -> GenerationParams:
    size = parse_size(body.size)
    params = GenerationParams(
        width=size[0] if size else None,
        height=size[1] if size else None,
        num_inference_steps=body.num_inference_steps,
        guidance_scale=body.guidance_scale,
        negative_prompt=body.negative_prompt,
        seed=body.seed,
        fps=body.fps or DEFAULT_FPS,
        num_frames=video_frames(body),
    )
    check_limits(params, limits, body.prompt)
    return params
