"""The one place where errors become HTTP responses: the OpenAI envelope and retry headers."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm_omni_like.errors import (
    ErrorInfo,
    ErrorKind,
    InvalidRequestError,
    NotFoundError,
    OmniError,
    classify,
)
from vllm_omni_like.protocol.envelope import envelope

logger = logging.getLogger(__name__)


def headers_for(info: ErrorInfo, engine_errored: bool = False) -> dict[str, str]:
    """Retry headers of API.md, so the SDK does not re-run work that will fail again."""
    headers: dict[str, str] = {}
    if info.status in (409, 422, 500, 504):
        headers["x-should-retry"] = "false"
    if info.kind is ErrorKind.QUEUE_FULL:
        headers["Retry-After"] = str(max(1, round(info.retry_after or 1)))
    elif info.kind is ErrorKind.UNAVAILABLE:
        headers["Retry-After"] = str(max(1, round(info.retry_after or 2)))
    elif info.kind is ErrorKind.DEAD or (info.status == 503 and engine_errored):
        headers["x-should-retry"] = "false"
    return headers


def error_response(
    info: ErrorInfo, request_id: str | None, engine_errored: bool = False
) -> JSONResponse:
    return JSONResponse(
        envelope(info, request_id),
        status_code=info.status,
        headers=headers_for(info, engine_errored),
    )


def validation_error(exc: RequestValidationError) -> InvalidRequestError:
    """pydantic's 422 becomes a 400 naming the field path (or, for a body that is not JSON,
    what is wrong and where)."""
    errors = exc.errors()
    first: dict[str, Any] = dict(errors[0]) if errors else {"loc": (), "msg": "invalid request"}
    if first.get("type") == "json_invalid":
        where = first.get("loc", ())[-1] if first.get("loc") else None
        what = (first.get("ctx") or {}).get("error") or "not valid JSON"
        at = f" at character {where}" if isinstance(where, int) else ""
        return InvalidRequestError(f"the request body is not valid JSON: {what}{at}", param=None)
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "form")]
    param = ".".join(loc) or None
    msg = str(first.get("msg") or "invalid request")
    return InvalidRequestError(f"{param}: {msg}" if param else msg, param=param)


def http_error(request: Request, exc: Exception) -> ErrorInfo:
    """What the web framework raised (validation, routing), or anything else, as our value."""
    if isinstance(exc, RequestValidationError):
        return validation_error(exc).info
    if isinstance(exc, StarletteHTTPException):
        if exc.status_code == 404:
            return NotFoundError(f"no route {request.method} {request.url.path}").info
        if exc.status_code == 405:
            what = f"{request.method} is not allowed on {request.url.path}"
            return ErrorInfo(ErrorKind.METHOD_NOT_ALLOWED, what)
        kind = next((k for k in ErrorKind if k.value.status == exc.status_code), ErrorKind.INVALID)
        return ErrorInfo(kind, str(exc.detail) or "bad request")
    if not isinstance(exc, OmniError):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return ErrorInfo(ErrorKind.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")
    return classify(exc)


def install(app: FastAPI) -> None:
    def request_id(request: Request) -> str | None:
        return getattr(request.state, "request_id", None)

    def errored(request: Request) -> bool:
        engine = getattr(request.app.state, "engine", None)
        return bool(engine is not None and engine.errored)

    @app.exception_handler(Exception)
    async def handle(request: Request, exc: Exception) -> JSONResponse:
        info = http_error(request, exc)
        if info.kind is ErrorKind.ABORTED:  # nobody is left to read a response
            logger.info("%s %s: the client disconnected", request.method, request.url.path)
        elif info.status >= 500:
            where = f"{request.method} {request.url.path}"
            logger.info("%s -> %d %s", where, info.status, info.message)
        if not getattr(request.state, "admitted", False):  # refused before admission
            request.app.state.engine.stats.reject(info.status)
        return error_response(info, request_id(request), errored(request))

    app.add_exception_handler(RequestValidationError, handle)
    app.add_exception_handler(StarletteHTTPException, handle)
    app.add_exception_handler(OmniError, handle)
