"""The HTTP server: uvicorn with a deadline on each request's headers and body, and a drain
whose cut-off answers every request it ends (OpenAI envelope, 503), never a bare 500."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import signal
import threading
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI

from vllm_omni_like.api.errors import headers_for
from vllm_omni_like.config import ServerSettings
from vllm_omni_like.errors import ClientTimeoutError, OmniError, ShuttingDownError
from vllm_omni_like.protocol.envelope import envelope

try:  # uvicorn's faster parser where installed, else its pure-Python one
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _BaseProtocol
except ImportError:  # pragma: no cover - depends on the environment
    from uvicorn.protocols.http.h11_impl import (  # type: ignore[assignment]  # same interface
        H11Protocol as _BaseProtocol,
    )

logger = logging.getLogger(__name__)

CUTOFF_GRACE_S = 5.0  # after the cut-off, time for the 503s to be written before uvicorn cancels


class OmniConfig(uvicorn.Config):
    """uvicorn's config plus the per-connection read deadlines (seconds)."""

    def __init__(
        self,
        app: Any,
        *,
        header_timeout: float,
        body_timeout: float,
        on_reject: Callable[[int], None] | None = None,
        **kw: Any,
    ) -> None:
        # log_config=None: uvicorn's lines go through the process's logging (timestamped)
        super().__init__(app, http=DeadlineProtocol, log_config=None, **kw)
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.on_reject = on_reject or (lambda status: None)


def _raw_response(info: Any, request_id: str) -> bytes:
    body = json.dumps(envelope(info, request_id)).encode()
    reason = {408: "Request Timeout", 503: "Service Unavailable"}.get(info.status, "Error")
    head = [
        f"HTTP/1.1 {info.status} {reason}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        f"x-request-id: {request_id}",
        *(f"{k}: {v}" for k, v in headers_for(info).items()),
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


class DeadlineProtocol(_BaseProtocol):
    """A request's headers must arrive within `header_timeout` of its first byte (or of the
    connection opening), and its body within `body_timeout` of the headers; a client that is
    slower gets a 408 and the connection closes. uvicorn has neither deadline of its own."""

    config: OmniConfig  # (the server's: `http=DeadlineProtocol` is set by OmniConfig only)

    # uvicorn declares a BaseTransport; the event loop hands a Transport (it reads and writes)
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # a Transport
        self._timer: asyncio.TimerHandle | None = None
        self._phase: str | None = None  # "headers" | "body" while a deadline runs
        self._seen: Any = None  # the request cycle whose headers were last seen complete
        super().connection_made(transport)
        self._arm("headers")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm("headers")  # the first bytes of the next request on this connection
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.cycle is self._seen:
            self._disarm()  # answered (perhaps before its body was read): nothing to wait for
        self._track()  # a pipelined request may have started

    def _track(self) -> None:
        cycle = self.cycle
        if cycle is not None and cycle is not self._seen:  # a new request's headers are in
            self._seen = cycle
            if cycle.more_body and not cycle.response_complete:
                self._arm("body")
            else:
                self._disarm()
        elif self._phase == "body" and (cycle is None or not cycle.more_body):
            self._disarm()

    def _arm(self, phase: str) -> None:
        self._disarm()
        limit = self.config.header_timeout if phase == "headers" else self.config.body_timeout
        self._phase = phase
        self._timer = self.loop.call_later(limit, self._expired, phase, limit)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._phase = None, None

    def _expired(self, phase: str, limit: float) -> None:
        self._timer = None
        flag = "--header-timeout" if phase == "headers" else "--body-timeout"
        what = "request headers" if phase == "headers" else "request body"
        error = ClientTimeoutError(f"the {what} did not arrive within {limit:g}s ({flag})")
        logger.info("%s: closing the connection: %s", self._peer(), error.message)
        self.answer_and_close(error)

    def answer_and_close(self, error: OmniError) -> None:
        """Answer `error` now unless a response has started; close; the app sees a disconnect."""
        self._disarm()
        if self.transport.is_closing():
            return
        cycle = self.cycle if self.cycle is self._seen else None
        if cycle is None or not cycle.response_started:
            self.config.on_reject(error.status)
            self.transport.write(_raw_response(error.info, self._request_id(cycle)))
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's sends are dropped, its receive sees the end
            cycle.message_event.set()
        self.transport.close()

    def _request_id(self, cycle: Any) -> str:
        if cycle is not None:
            known = cycle.scope.get("state", {}).get("request_id")
            if known:
                return known
            for name, value in cycle.scope.get("headers", ()):
                if name == b"x-request-id" and value:
                    return value.decode("latin-1")
        return f"req_{secrets.token_hex(12)}"

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "a client"


class OmniServer(uvicorn.Server):
    """SIGTERM/SIGINT drain: stop accepting, let in-flight work finish for `drain_timeout`,
    then cut off what is left with a 503 `shutting_down` and exit 0."""

    def __init__(self, config: OmniConfig, app: FastAPI, drain_timeout: float) -> None:
        super().__init__(config)
        self.app = app
        self.drain_timeout = drain_timeout

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn would re-raise the signal after the shutdown and die by it; we exit 0
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: Any = None) -> None:
        server = self.app.state.server
        loop = asyncio.get_running_loop()
        server.begin_drain(loop.time() + self.drain_timeout)
        cut = asyncio.create_task(self._cut_off_later())
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()

    async def _cut_off_later(self) -> None:
        await asyncio.sleep(self.drain_timeout)
        message = (
            f"the server shut down before the request finished (--drain-timeout "
            f"{self.drain_timeout:g}s)"
        )
        reading = [c for c in self.server_state.connections if isinstance(c, DeadlineProtocol)]
        reading = [c for c in reading if c._phase is not None]  # nothing of the app answers
        if reading or self.app.state.server.engine.started:
            logger.warning("drain timeout: ending what is still running with 503 shutting_down")
        error = ShuttingDownError(message)
        for connection in reading:  # still sending its request: answered here
            connection.answer_and_close(error)
        self.app.state.server.cut_off(message)


def build_server(app: FastAPI, settings: ServerSettings, log_level: str = "info") -> OmniServer:
    """The one way this project runs uvicorn (the serve command and the tests)."""
    config = OmniConfig(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        access_log=False,
        header_timeout=settings.header_timeout,
        body_timeout=settings.body_timeout,
        on_reject=app.state.engine.stats.reject,
        timeout_graceful_shutdown=int(settings.drain_timeout + CUTOFF_GRACE_S),
    )
    return OmniServer(config, app, settings.drain_timeout)
