"""ASGI middleware: request ids on every response, API keys, and the request body limit."""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from vllm_omni_like.api.errors import headers_for
from vllm_omni_like.errors import AuthenticationError, OmniError, PayloadTooLargeError
from vllm_omni_like.protocol.envelope import envelope

PUBLIC_PREFIXES = ("/health", "/metrics", "/version", "/v1/files/", "/playground/")
PUBLIC_PATHS = ("/", "/favicon.ico")  # the playground page: it asks for the key itself
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class GatewayMiddleware:
    def __init__(
        self, app, api_keys: tuple[str, ...], max_body_bytes: int, on_reject: Callable[[int], None]
    ) -> None:
        self.app = app
        self.on_reject = on_reject
        self.api_keys = set(api_keys)
        self.max_body = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # latin-1 decodes any byte: a header that is not UTF-8 must not turn into a 500
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        # the engine keys requests on an id of its own, so two requests that send the same
        # x-request-id never share, overwrite or abort each other; the client's is echoed
        client_id = headers.get("x-request-id")
        if client_id:  # the client's id stays visible in the engine's logs
            engine_id = f"{client_id}~{secrets.token_hex(6)}"
        else:
            engine_id = client_id = f"req_{secrets.token_hex(12)}"
        request_id = client_id  # what every response echoes
        state = scope.setdefault("state", {})
        state["request_id"], state["engine_request_id"] = request_id, engine_id

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode())]
            await send(message)

        # 1) API key, except on probes and the unguessable file URLs
        path = scope["path"]
        if self.api_keys and not (path.startswith(PUBLIC_PREFIXES) or path in PUBLIC_PATHS):
            auth = headers.get("authorization", "")
            token = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
            if token not in self.api_keys:
                err = AuthenticationError("missing API key" if not token else "invalid API key")
                self.on_reject(err.status)
                await _respond(send_with_id, err, request_id)
                return
        # 2) body size, declared and actual
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            self.on_reject(413)
            await _respond(send_with_id, _too_large(self.max_body), request_id)
            return
        if declared is None and scope["method"] in ("POST", "PUT", "PATCH"):
            # chunked: read it here, so a body over the limit is a 413 and not whatever the
            # route's body parser makes of an error raised while it reads
            body = await _read_bounded(receive, self.max_body)
            if body is None:
                self.on_reject(413)
                await _respond(send_with_id, _too_large(self.max_body), request_id)
                return
            receive = _replay(body, receive)
        seen = 0

        async def counting_receive() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body:
                    raise _too_large(self.max_body)
            return message

        await self.app(scope, counting_receive, send_with_id)


async def _read_bounded(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None once it is over `limit` bytes (or the client left)."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        parts.append(message.get("body", b""))
        size += len(parts[-1])
        if size > limit:
            return None
        if not message.get("more_body", False):
            return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives `body` once, then waits on the client (for its disconnect)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _too_large(limit: int) -> PayloadTooLargeError:
    return PayloadTooLargeError(f"request body is over the limit of {limit} bytes")


async def _respond(send: Send, err: OmniError, request_id: str) -> None:
    info = err.info
    body = json.dumps(envelope(info, request_id)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in headers_for(info).items()]
    await send({"type": "http.response.start", "status": info.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
