"""The error taxonomy: every failure is one of these until the HTTP handler answers it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar


@dataclass(frozen=True)
class ErrorInfo:
    """A picklable description of an error: what crosses threads and processes."""

    error_class: str
    message: str
    type: str
    code: str
    status: int
    recoverable: bool
    stage: str | None = None
    param: str | None = None
    retry_after: float | None = None

    def to_exception(self) -> OmniError:
        cls = _BY_NAME.get(self.error_class, EngineGenerateError)
        return cls(
            self.message,
            code=self.code,
            stage=self.stage,
            param=self.param,
            retry_after=self.retry_after,
        )


class OmniError(Exception):
    """Base of the taxonomy; each subclass fixes the HTTP status, type and default code."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    default_code: ClassVar[str] = "internal_error"
    recoverable: ClassVar[bool] = True

    def __init__(
        self,
        message: str = "",
        *,
        code: str | None = None,
        stage: str | None = None,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        message = message.strip() or f"{type(self).__name__} (no detail given)"
        if stage and not message.startswith(f"stage '{stage}'"):
            message = f"stage '{stage}': {message}"
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.stage = stage
        self.param = param
        self.retry_after = retry_after

    def info(self) -> ErrorInfo:
        return ErrorInfo(
            error_class=type(self).__name__,
            message=self.message,
            type=self.type,
            code=self.code,
            status=self.status,
            recoverable=self.recoverable,
            stage=self.stage,
            param=self.param,
            retry_after=self.retry_after,
        )

    def __reduce__(self):  # keyword-only fields survive pickling
        return (_rebuild, (self.info(),))


def _rebuild(info: ErrorInfo) -> OmniError:
    return info.to_exception()


class InvalidRequestError(OmniError):
    status = 400
    type = "invalid_request_error"
    default_code = "invalid_request"


class AuthenticationError(OmniError):
    status = 401
    type = "invalid_request_error"
    default_code = "invalid_api_key"


class NotFoundError(OmniError):
    status = 404
    type = "invalid_request_error"
    default_code = "not_found"


class ConflictError(OmniError):
    status = 409
    type = "invalid_request_error"
    default_code = "conflict"


class PayloadTooLargeError(OmniError):
    status = 413
    type = "invalid_request_error"
    default_code = "payload_too_large"


class QueueFullError(OmniError):
    status = 429
    type = "rate_limit_error"
    default_code = "queue_full"


class EngineGenerateError(OmniError):
    """This request failed inside a stage; the engine stays healthy."""

    status = 500
    type = "server_error"
    default_code = "generation_failed"


class EngineDeadError(OmniError):
    """A stage has no live replica and none is being restarted (or is starting)."""

    status = 503
    type = "service_unavailable"
    default_code = "engine_dead"
    recoverable = False


class RequestTimeoutError(OmniError):
    status = 504
    type = "timeout_error"
    default_code = "timeout"


class ClientTimeoutError(OmniError):
    """The client did not send its request (headers or body) in time."""

    status = 408
    type = "invalid_request_error"
    default_code = "request_timeout"


_BY_NAME: dict[str, type[OmniError]] = {
    cls.__name__: cls
    for cls in (
        OmniError,
        InvalidRequestError,
        AuthenticationError,
        NotFoundError,
        ConflictError,
        PayloadTooLargeError,
        QueueFullError,
        EngineGenerateError,
        EngineDeadError,
        RequestTimeoutError,
        ClientTimeoutError,
    )
}


def classify(exc: BaseException, stage: str | None = None) -> OmniError:
    """Keep a taxonomy error as it is; any other exception is a recoverable generate error."""
    if isinstance(exc, OmniError):
        if stage and exc.stage is None:
            return replace(exc.info(), stage=stage).to_exception()
        return exc
    detail = str(exc).strip() or type(exc).__name__
    return EngineGenerateError(f"{type(exc).__name__}: {detail}", stage=stage)
