"""What a caller hands the engine: one request (the API, the offline command and chat build
it). Data only, in-process (the orchestrator turns it into each stage's `wire.StageRequest`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_omni_like.params import GenerationParams


@dataclass
class OmniRequest:
    """One request to the engine, as the API or the offline command builds it."""

    request_id: str
    prompt: str
    pipeline: str
    params: GenerationParams = field(default_factory=GenerationParams)
    images: list[Any] = field(default_factory=list)
    mask: Any | None = None
    timeout: float | None = None  # seconds; the engine's default when None
    # the client's own id (x-request-id), carried for logs; the engine keys on request_id
    client_id: str | None = None
    # the caller writes the output to a file: the engine records its success once the caller
    # reports the write done (`AsyncOmni.store`), a failed write as an error
    stores_output: bool = False
    # run stages 0..last_stage only (a chat completion stops after the LLM stage); None: all
    last_stage: int | None = None
    # the consumer keeps the encoded files only (a video job, the offline command): a video
    # whose MP4 and thumbnail the stage encoded comes without its frames, which stay in the
    # worker (33 frames of 832x480 are 40 MB to carry between processes)
    files_only: bool = False
    # the consumer encodes the images as PNG: a stage on a GPU sends each large image's rows
    # PNG-filtered beside its pixels (ImagePayload.scanlines), so that only deflate is left
    encodes_png: bool = False
