"""vllm_omni_like: serve multi-stage generative pipelines (an LLM stage chained to diffusion).

The public API is what `__all__` names: the engines (`Omni` offline, `AsyncOmni` on an event
loop), a request and its params, the outputs, the configs and a named pipeline's
(`resolve_pipeline`), the errors, and `encode_image` for an output's pixels. Importing it never
imports torch (the workers do)."""

from vllm_omni_like.config import EngineConfig, PipelineConfig, StageConfig
from vllm_omni_like.engine import AsyncOmni, Omni, new_request_id
from vllm_omni_like.errors import (
    AuthenticationError,
    ConfigError,
    ConflictError,
    EngineDeadError,
    EngineGenerateError,
    ErrorInfo,
    InvalidRequestError,
    NotFoundError,
    OmniError,
    PayloadTooLargeError,
    QueueFullError,
    RequestTimeoutError,
)
from vllm_omni_like.inputs import OmniRequest
from vllm_omni_like.media import encode_image
from vllm_omni_like.outputs import ImagePayload, OmniRequestOutput, StageOutput, VideoPayload
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.pipelines.catalog import resolve as resolve_pipeline

__version__ = "0.1.0"

__all__ = [
    "AsyncOmni",
    "AuthenticationError",
    "ConfigError",
    "ConflictError",
    "EngineConfig",
    "EngineDeadError",
    "EngineGenerateError",
    "ErrorInfo",
    "GenerationParams",
    "ImagePayload",
    "InvalidRequestError",
    "NotFoundError",
    "Omni",
    "OmniError",
    "OmniRequest",
    "OmniRequestOutput",
    "PayloadTooLargeError",
    "PipelineConfig",
    "QueueFullError",
    "RequestTimeoutError",
    "StageConfig",
    "StageOutput",
    "VideoPayload",
    "__version__",
    "encode_image",
    "new_request_id",
    "resolve_pipeline",
]
