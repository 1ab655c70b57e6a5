"""What stages and the engine return: stage outputs, media payloads, the request output."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_omni_like.errors import ErrorInfo, classify


@dataclass
class ImagePayload:
    """One image as an HxWx3 uint8 array (numpy), plus the seed that made it."""

    pixels: Any
    seed: int | None = None
    # the pixels' rows PNG-filtered, (H, 1 + W * 3) uint8 (png.filter_rows's output), where a
    # GPU stage made them for a consumer that encodes PNG (OmniRequest.encodes_png); None: not
    scanlines: Any = None


@dataclass
class VideoPayload:
    """A clip as an FxHxWx3 uint8 array (numpy); None when the request wanted its files only
    (`OmniRequest.files_only`) and the stage encoded both: `dims` then says its size."""

    frames: Any
    fps: int
    seed: int | None = None
    mp4: bytes | None = None  # the frames encoded as H.264 MP4, when the stage did it
    thumbnail: bytes | None = None  # the middle frame as PNG, when the stage did it
    dims: tuple[int, int, int] | None = None  # frames, height, width: only without `frames`

    @property
    def shape(self) -> tuple[int, int, int]:
        """Frames, height, width."""
        if self.frames is not None:
            return tuple(self.frames.shape[:3])
        assert self.dims is not None, "a video without frames carries its dims"
        return self.dims


@dataclass
class StageOutput:
    """One stage's result for one request: text and/or media, or an error."""

    request_id: str
    stage: str
    text: str | None = None
    token_ids: list[int] | None = None
    # an LLM stage's: "stop" or "length", the prompt's token count, per-token log-probabilities
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0  # tokens sampled, an end of sequence included
    logprobs: list[dict[str, Any]] | None = None
    images: list[ImagePayload] = field(default_factory=list)
    video: VideoPayload | None = None
    error: ErrorInfo | None = None
    steps_run: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_error(cls, request_id: str, exc: BaseException, stage: str) -> StageOutput:
        return cls(request_id=request_id, stage=stage, error=classify(exc, stage))


@dataclass
class TextDelta:
    """An LLM row's text since its last step (streamed chat): its new tokens and their
    log-probabilities, if asked."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[str, Any]] | None = None


@dataclass
class RequestProgress:
    """A step of a stage finished for this request (previews: partial images, if asked)."""

    request_id: str
    stage: str
    step: int
    total: int
    previews: Any = None


@dataclass
class OmniRequestOutput:
    """The final answer to one request: the last stage's output, or the error that ended it."""

    request_id: str
    stage_id: str | None = None
    finished: bool = True
    output: StageOutput | None = None
    revised_prompt: str | None = None
    error: ErrorInfo | None = None
    stage_outputs: dict[str, StageOutput] = field(default_factory=dict)

    @property
    def result(self) -> StageOutput:
        """The output of a request that succeeded (a caller checks `error` first)."""
        if self.output is None:
            raise ValueError(f"request {self.request_id} has no output (error: {self.error})")
        return self.output

    @classmethod
    def from_error(
        cls, request_id: str, exc: BaseException, stage_id: str | None
    ) -> OmniRequestOutput:
        return cls(request_id=request_id, stage_id=stage_id, error=classify(exc, stage_id))

    @property
    def ok(self) -> bool:
        return self.error is None


# what the engine hands a request's listener: its progress, then its final output
RequestEvent = RequestProgress | OmniRequestOutput
