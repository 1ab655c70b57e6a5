"""What api/http_server.py relies on inside uvicorn, which it subclasses (its HTTP protocol
classes and its Server): checked here so that a uvicorn release that renames or drops one fails
this test loudly, not the deadlines or the drain silently. pyproject.toml pins uvicorn to the
releases this passed on."""

from __future__ import annotations

import inspect

import pytest
import uvicorn
from uvicorn.protocols.http import h11_impl

from vllm_omni_like.api import http_server

# the protocol's methods it overrides or calls, and the attributes it reads
PROTOCOL_METHODS = ("connection_made", "connection_lost", "data_received", "on_response_complete")
PROTOCOL_ATTRIBUTES = ("cycle", "transport", "loop", "client", "config")
# the request cycle's attributes it reads or sets (answer_and_close, _track, _request_id)
CYCLE_ATTRIBUTES = (
    "scope",
    "more_body",
    "response_started",
    "response_complete",
    "disconnected",
    "message_event",
)
# the Server's parts it overrides or reads (the drain)
SERVER_PARTS = ("capture_signals", "handle_exit", "shutdown", "server_state")


def _protocol_classes() -> list[type]:
    classes = [h11_impl.H11Protocol]
    try:
        from uvicorn.protocols.http import httptools_impl
    except ImportError:
        return classes
    return [*classes, httptools_impl.HttpToolsProtocol]


def test_uvicorn_is_a_release_the_pin_allows():
    major, minor = (int(part) for part in uvicorn.__version__.split(".")[:2])
    assert (major, minor) == (0, 54), uvicorn.__version__  # pyproject.toml: >=0.54,<0.55


@pytest.mark.parametrize("cls", _protocol_classes(), ids=lambda c: c.__name__)
def test_the_protocol_parts_the_deadlines_use_are_there(cls):
    for name in PROTOCOL_METHODS:
        assert callable(getattr(cls, name, None)), f"{cls.__name__}.{name}"
    init = inspect.getsource(cls.__init__)
    for name in PROTOCOL_ATTRIBUTES:
        assert f"self.{name} " in init or f"self.{name}:" in init, f"{cls.__name__}.{name}"
    module = inspect.getmodule(cls)
    cycle = inspect.getsource(module.RequestResponseCycle.__init__)
    for name in CYCLE_ATTRIBUTES:
        assert f"self.{name} " in cycle or f"self.{name}:" in cycle, f"cycle.{name}"
    assert issubclass(http_server.DeadlineProtocol, _protocol_classes()[-1])


def test_the_server_parts_the_drain_uses_are_there():
    server = uvicorn.Server(uvicorn.Config(app=lambda scope, receive, send: None))
    for name in SERVER_PARTS:
        assert hasattr(server, name), f"Server.{name}"
    assert isinstance(server.server_state.connections, set)
    assert "sockets" in inspect.signature(uvicorn.Server.shutdown).parameters
