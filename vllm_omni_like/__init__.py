"""vllm_omni_like: serve multi-stage generative pipelines (an LLM stage chained to diffusion)."""

from vllm_omni_like.config import EngineConfig, PipelineConfig, StageConfig
from vllm_omni_like.errors import (
    AuthenticationError,
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
from vllm_omni_like.outputs import ImagePayload, OmniRequestOutput, StageOutput, VideoPayload
from vllm_omni_like.params import GenerationParams

__version__ = "0.1.0"

__all__ = [
    "AuthenticationError",
    "ConflictError",
    "EngineConfig",
    "EngineDeadError",
    "EngineGenerateError",
    "ErrorInfo",
    "GenerationParams",
    "ImagePayload",
    "InvalidRequestError",
    "NotFoundError",
    "OmniError",
    "OmniRequestOutput",
    "PayloadTooLargeError",
    "PipelineConfig",
    "QueueFullError",
    "RequestTimeoutError",
    "StageConfig",
    "StageOutput",
    "VideoPayload",
    "__version__",
]
