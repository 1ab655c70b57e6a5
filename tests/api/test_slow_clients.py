"""Slow clients over raw sockets: headers and bodies have deadlines (--header-timeout,
--body-timeout); a client past them gets a 408 envelope and its connection closes."""

from __future__ import annotations

import contextlib
import json
import socket
import time

import pytest

from tests.api.conftest import live_server
from tests.conftest import wait_for

HEADER_S, BODY_S = 1.0, 1.5


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory):
    with live_server(
        tmp_path_factory,
        "null-image",
        settings_kw={"header_timeout": HEADER_S, "body_timeout": BODY_S},
    ) as server:
        yield server


def _connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def _read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _response(data: bytes) -> tuple[str, dict]:
    head, _, body = data.partition(b"\r\n\r\n")
    return head.decode("latin-1").lower(), json.loads(body)


def _trickle(sock: socket.socket, pieces) -> tuple[bytes, float]:
    """Send a piece every 0.3 s until the server answers and closes: its answer, and how long
    after the first piece it came."""
    start, data = time.monotonic(), b""
    sock.settimeout(0.3)
    for piece in pieces:
        try:
            sock.sendall(piece)
            chunk = sock.recv(65536)
        except (TimeoutError, BlockingIOError):
            continue
        except (BrokenPipeError, ConnectionResetError):
            break
        data += chunk
        if not chunk:
            break
    took = time.monotonic() - start
    sock.settimeout(5)
    with contextlib.suppress(ConnectionResetError):
        data += _read_all(sock)
    return data, took


def _open_connections(server) -> int:
    return len(server.server.server_state.connections)


def test_headers_that_trickle_get_a_408_at_the_header_timeout(slow_server):
    before = slow_server.engine.stats.snapshot()
    rejected = before["rejected"].get(408, 0)
    with _connect(slow_server) as sock:
        sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\n")
        data, took = _trickle(sock, (f"X-Slow-{i}: 1\r\n".encode() for i in range(20)))
    head, body = _response(data)
    assert head.startswith("http/1.1 408"), head
    assert "x-request-id: req_" in head and "connection: close" in head
    assert body["error"]["code"] == "request_timeout"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"] == (
        f"the request headers did not arrive within {HEADER_S:g}s (--header-timeout)"
    )
    assert HEADER_S - 0.05 <= took <= HEADER_S + 1.5, took
    wait_for(
        lambda: slow_server.engine.stats.snapshot()["rejected"].get(408, 0) == rejected + 1,
        5,
        "the 408 counted as a rejection",
    )
    after = slow_server.engine.stats.snapshot()
    assert after["requests_total"] == before["requests_total"]  # nothing was admitted


def test_a_body_that_trickles_gets_a_408_at_the_body_timeout(slow_server):
    with _connect(slow_server) as sock:
        sock.sendall(
            b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nX-Request-Id: trickle-1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 200\r\n\r\n"
        )
        # a byte every 0.3 s: the 200 bytes would take a minute
        data, took = _trickle(sock, (b" " for _ in range(30)))
    head, body = _response(data)
    assert head.startswith("http/1.1 408"), head
    assert "x-request-id: trickle-1" in head  # the client's own id, as on every response
    assert body["error"]["request_id"] == "trickle-1"
    assert body["error"]["message"] == (
        f"the request body did not arrive within {BODY_S:g}s (--body-timeout)"
    )
    assert BODY_S - 0.05 <= took <= BODY_S + 1.5, took
    wait_for(lambda: _open_connections(slow_server) == 0, 5, "the connection closed")


def test_many_idle_and_half_sent_connections_are_all_closed(slow_server):
    socks = []
    try:
        for i in range(40):
            sock = _connect(slow_server)
            if i % 2:  # half send part of a request line, half nothing at all
                sock.sendall(b"GET /health HTTP/1.1\r\nHo")
            socks.append(sock)
        wait_for(lambda: _open_connections(slow_server) == 40, 5, "40 connections open")
        start = time.monotonic()
        wait_for(lambda: _open_connections(slow_server) == 0, HEADER_S + 3, "all closed")
        assert time.monotonic() - start <= HEADER_S + 3
        for sock in socks:  # each got its 408 before the close
            sock.settimeout(5)
            assert _read_all(sock).startswith(b"HTTP/1.1 408")
    finally:
        for sock in socks:
            sock.close()


def test_a_keep_alive_connection_idle_between_requests_is_not_cut(slow_server):
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with _connect(slow_server) as sock:
        for _ in range(2):  # the second comes after longer than the header timeout
            sock.sendall(request)
            data = b""
            while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
                data += sock.recv(65536)
            assert data.startswith(b"HTTP/1.1 200"), data[:80]
            time.sleep(HEADER_S + 0.5)


def test_a_prompt_client_is_not_cut_and_a_large_body_in_time_is_read(slow_server):
    with slow_server.http() as http:
        big = {"prompt": "a red circle", "user": "x" * 900_000}  # read in full, in time
        r = http.post("/v1/images/generations", json=big)
        assert r.status_code == 200 and r.json()["data"], r.text[:300]
        ok = http.post("/v1/images/generations", json={"prompt": "a red circle"})
        assert ok.status_code == 200 and ok.json()["data"]
