"""The error taxonomy: an error is one value (`ErrorInfo`, a kind and its detail) from where it
is raised to the HTTP handler; the exceptions only carry that value through `raise`. Outside
it: `ConfigError` (a start-up misconfiguration, no request's doing) and the worker's device
errors (recognised by torch's types; this module never imports torch)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, ClassVar, NamedTuple


class Kind(NamedTuple):
    status: int  # the HTTP status
    type: str  # OpenAI's error type
    code: str  # the default code (a raise may name a finer one)
    final: str  # the request's final status in the metrics
    recoverable: bool = True  # False: the engine is dead (`/health` 503)


class ErrorKind(Enum):
    """Every way a request can end other than success; each fixes everything but the detail."""

    INVALID = Kind(400, "invalid_request_error", "invalid_request", "invalid")
    UNAUTHORIZED = Kind(401, "invalid_request_error", "invalid_api_key", "invalid")
    NOT_FOUND = Kind(404, "invalid_request_error", "not_found", "invalid")
    METHOD_NOT_ALLOWED = Kind(405, "invalid_request_error", "method_not_allowed", "invalid")
    CLIENT_TIMEOUT = Kind(408, "invalid_request_error", "request_timeout", "invalid")
    CONFLICT = Kind(409, "invalid_request_error", "conflict", "invalid")
    TOO_LARGE = Kind(413, "invalid_request_error", "payload_too_large", "invalid")
    VIDEO_FAILED = Kind(422, "invalid_request_error", "video_failed", "error")
    QUEUE_FULL = Kind(429, "rate_limit_error", "queue_full", "invalid")
    ABORTED = Kind(499, "invalid_request_error", "aborted", "aborted")  # the client left
    GENERATE = Kind(500, "server_error", "generation_failed", "error")
    STORAGE = Kind(500, "server_error", "storage_error", "error")
    INTERNAL = Kind(500, "server_error", "internal_error", "error")
    UNAVAILABLE = Kind(503, "service_unavailable", "restarting", "error")  # come back later
    SHUTTING_DOWN = Kind(503, "service_unavailable", "shutting_down", "aborted")
    DEAD = Kind(503, "service_unavailable", "engine_dead", "dead", recoverable=False)
    TIMEOUT = Kind(504, "timeout_error", "timeout", "timeout")


# the kinds an abort ends a request with: the client left, its deadline passed, the drain ended
ABORT_KINDS = (ErrorKind.ABORTED, ErrorKind.TIMEOUT, ErrorKind.SHUTTING_DOWN)


class DeathCause(Enum):
    """Why a replica's workers died, in the words a request that was there is told."""

    CRASHED = "crashed the worker"  # it exited or was killed by a signal
    STALLED = "stalled its worker"  # the engine killed it: no progress within its bound


@dataclass(frozen=True)
class ErrorInfo:
    """A picklable error: what crosses threads and processes, and what the client is told."""

    kind: ErrorKind
    message: str = ""
    code: str = ""  # empty: the kind's default
    stage: str | None = None
    param: str | None = None
    retry_after: float | None = None

    def __post_init__(self) -> None:
        message = self.message.strip() or f"{self.kind.name.lower()} (no detail given)"
        if self.stage and not message.startswith(f"stage '{self.stage}'"):
            message = f"stage '{self.stage}': {message}"
        object.__setattr__(self, "message", message)
        object.__setattr__(self, "code", self.code or self.kind.value.code)

    @property
    def status(self) -> int:
        return self.kind.value.status

    @property
    def type(self) -> str:
        return self.kind.value.type

    @property
    def recoverable(self) -> bool:
        return self.kind.value.recoverable

    @property
    def final_status(self) -> str:
        return self.kind.value.final

    def at_stage(self, stage: str) -> ErrorInfo:
        return self if self.stage is not None else replace(self, stage=stage)

    def error(self) -> OmniError:
        """The exception that carries this very value (its class is the kind's)."""
        return OmniError.of(self)


class OmniError(Exception):
    """Base of the taxonomy; each subclass names a kind, so `raise NotFoundError(...)` reads
    well and `except EngineDeadError` works on both sides of a process boundary."""

    kind: ClassVar[ErrorKind] = ErrorKind.INTERNAL
    _by_kind: ClassVar[dict[ErrorKind, type[OmniError]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        OmniError._by_kind.setdefault(cls.kind, cls)

    def __init__(
        self,
        message: str = "",
        *,
        code: str | None = None,
        stage: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        info = ErrorInfo(self.kind, message, code or "", stage, param, retry_after)
        super().__init__(info.message)
        self.info = info

    @staticmethod
    def of(info: ErrorInfo) -> OmniError:
        cls = OmniError._by_kind.get(info.kind, OmniError)
        exc = cls.__new__(cls)
        Exception.__init__(exc, info.message)
        exc.info = info
        return exc

    message = property(lambda self: self.info.message)
    code = property(lambda self: self.info.code)
    stage = property(lambda self: self.info.stage)
    param = property(lambda self: self.info.param)
    status = property(lambda self: self.info.status)
    retry_after = property(lambda self: self.info.retry_after)

    def __reduce__(
        self,
    ) -> tuple[
        Callable[[ErrorInfo], OmniError], tuple[ErrorInfo]
    ]:  # the value crosses processes, the class follows from its kind
        return (_rebuild, (self.info,))


def _rebuild(info: ErrorInfo) -> OmniError:
    return OmniError.of(info)


class InvalidRequestError(OmniError):
    kind = ErrorKind.INVALID


class AuthenticationError(OmniError):
    kind = ErrorKind.UNAUTHORIZED


class NotFoundError(OmniError):
    kind = ErrorKind.NOT_FOUND


class ConflictError(OmniError):
    kind = ErrorKind.CONFLICT


class PayloadTooLargeError(OmniError):
    kind = ErrorKind.TOO_LARGE


class QueueFullError(OmniError):
    kind = ErrorKind.QUEUE_FULL


class AbortedError(OmniError):
    """The client went away (or asked to stop): nobody reads the answer."""

    kind = ErrorKind.ABORTED


class EngineGenerateError(OmniError):
    """This request failed inside a stage; the engine stays healthy."""

    kind = ErrorKind.GENERATE


class StorageError(OmniError):
    """The output was made but could not be written."""

    kind = ErrorKind.STORAGE


class UnavailableError(OmniError):
    """Nothing can run the request now (starting, or every replica restarting): retry later."""

    kind = ErrorKind.UNAVAILABLE


class ShuttingDownError(OmniError):
    kind = ErrorKind.SHUTTING_DOWN


class EngineDeadError(OmniError):
    """A stage has no live replica and none is being restarted (or is starting)."""

    kind = ErrorKind.DEAD


class RequestTimeoutError(OmniError):
    kind = ErrorKind.TIMEOUT


class ClientTimeoutError(OmniError):
    """The client did not send its request (headers or body) in time."""

    kind = ErrorKind.CLIENT_TIMEOUT


def classify(exc: BaseException, stage: str | None = None) -> ErrorInfo:
    """The one classifier: a taxonomy error keeps its value (given the stage it happened in);
    any other exception is a recoverable generate error naming its type."""
    if isinstance(exc, OmniError):
        return exc.info.at_stage(stage) if stage else exc.info
    detail = str(exc).strip() or type(exc).__name__
    return ErrorInfo(ErrorKind.GENERATE, f"{type(exc).__name__}: {detail}", stage=stage)


# ---- outside the taxonomy ------------------------------------------------------------------------
class ConfigError(ValueError):
    """A start-up misconfiguration (a flag, a YAML pipeline, a stage option, the environment):
    the server or the offline command does not start, and the CLI prints the message. No
    request caused it, so it has no kind and no HTTP status."""


# ---- a worker's device failures (raised and classified inside workers, never sent) --------------
class FatalStageError(Exception):
    """The device is unusable (a CUDA error other than out-of-memory): the worker must exit."""


def _torch_error(*path: str) -> type[BaseException] | None:
    """torch's exception class at `path` (`"cuda", "OutOfMemoryError"`), if torch is imported
    already and has it: a device error comes from torch, so a process without torch has none,
    and the API process never imports torch for this."""
    found: object = sys.modules.get("torch")
    for name in path:
        found = getattr(found, name, None)
    return found if isinstance(found, type) and issubclass(found, BaseException) else None


def is_out_of_memory(exc: BaseException) -> bool:
    """The host's `MemoryError` (an injected or a CFG-parallel peer's out-of-memory too) or
    torch's device one."""
    oom = _torch_error("cuda", "OutOfMemoryError")  # torch.OutOfMemoryError, on any device
    return isinstance(exc, MemoryError) or (oom is not None and isinstance(exc, oom))


def is_fatal_device_error(exc: BaseException) -> bool:
    """Anything but out-of-memory from the device: torch's `AcceleratorError` (torch >= 2.8),
    or a RuntimeError whose message says it is a CUDA or cuBLAS error (torch before 2.8, and
    some of its checks since, raise those so)."""
    if is_out_of_memory(exc):
        return False
    accelerator = _torch_error("AcceleratorError")
    if accelerator is not None and isinstance(exc, accelerator):
        return True
    text = str(exc)
    return "CUDA error" in text or "CUBLAS_" in text
