"""R16: the server out of file descriptors (a low `ulimit -n` and many half-sent requests)
when its worker dies. Restarts that fail for lack of descriptors wait for room without
spending the restart budget; once the connections close, the stage comes back."""

from __future__ import annotations

import signal
import socket

import httpx
import psutil
import pytest

from tests.conftest import wait_for
from tests.reliability.procs import ServeProcess

pytestmark = pytest.mark.slow
NOFILE = 192


def _worker(server: ServeProcess) -> psutil.Process:
    return next(
        p
        for p in server.workers()
        if "resource_tracker" not in " ".join(p.cmdline()) and p.ppid() == server.proc.pid
    )


def test_r16_restarts_that_lack_descriptors_wait_for_room(tmp_path):
    server = ServeProcess(
        ["null-image", "--max-restarts", "3", "--header-timeout", "120"],
        str(tmp_path),
        nofile=NOFILE,
    )
    socks: list[socket.socket] = []
    try:
        server.wait_healthy()
        me = psutil.Process(server.proc.pid)
        for _ in range(NOFILE + 40):  # more half-sent requests than the server has descriptors
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            sock.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\n")
            socks.append(sock)
        wait_for(lambda: me.num_fds() >= NOFILE - 2, 10, "the server out of descriptors")
        _worker(server).send_signal(signal.SIGKILL)
        # more failed restarts than the budget of 3: each lacked descriptors, none was spent
        failed = (
            "restart of null-image replica 0 failed: stage 'diffusion': OSError: [Errno 24] "
            "Too many open files"
        )
        wait_for(
            lambda: server.output().count(failed) >= 4,
            20,
            "restarts failing for lack of descriptors",
        )
        assert "no restart left" not in server.output()
        for sock in socks:
            sock.close()
        socks.clear()
        with httpx.Client(base_url=server.url, timeout=10) as http:
            health = wait_for(
                lambda: (r := http.get("/health")).status_code == 200 and r.json(),
                15,
                "the stage back once descriptors are free",
            )
            stage = health["stages"][0]
            assert stage["restarts"] == 1 and "restart_error" not in stage, stage
            r = http.post("/v1/images/generations", json={"prompt": "a dot"})
            assert r.status_code == 200 and r.json()["data"]
        assert server.proc.poll() is None
    finally:
        for sock in socks:
            sock.close()
        server.cleanup()
