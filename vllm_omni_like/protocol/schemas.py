"""Request and response schemas of the HTTP API (and of the offline batch lines)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from vllm_omni_like import config


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CacheRequest(_Strict):
    """A request's step cache (a stage served with --cache): its rows' own threshold."""

    threshold: float = Field(ge=0.0, le=10.0)  # 0: this request's rows never reuse


class LoraItem(_Strict):
    """A LoRA adapter a request picks (`/v1/models` lists them as `base:adapter`)."""

    name: str = Field(min_length=1, max_length=64)
    scale: float = Field(default=1.0, ge=-8.0, le=8.0)


class _Sampling(_Strict):
    """The extensions every generation route takes (sent through the SDK's `extra_body`)."""

    negative_prompt: str | None = None
    num_inference_steps: int | None = Field(default=None, ge=1)
    guidance_scale: float | None = Field(default=None, ge=0.0, le=100.0)
    seed: int | None = Field(default=None, ge=0, lt=2**31)
    scheduler: str | None = None  # a name the model's family runs (`/v1/models` lists them)
    cache: CacheRequest | None = None
    lora: list[LoraItem] | None = None  # LoRA adapters, each at its scale (protocol/loras.py)
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

    def cache_threshold(self) -> float | None:
        return None if self.cache is None else self.cache.threshold


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
    # a two-expert model's (Wan2.2-A14B) low-noise expert's scale; None: guidance_scale's
    guidance_scale_2: float | None = Field(default=None, ge=0.0, le=100.0)

    def family_params(self) -> dict[str, Any]:
        """The fields only some families take, as GenerationParams names them (models/ checks
        them against the model: models/limits.py)."""
        return {"guidance_scale_2": self.guidance_scale_2}

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
