"""R16, host resources: the server out of file descriptors (a low `ulimit -n` and many
half-sent requests) when its worker dies: restarts that fail for lack of descriptors wait for
room without spending the restart budget, and the stage comes back once the connections
close. And nothing of a dead worker outlives it (/dev/shm)."""

from __future__ import annotations

import os
import signal
import socket

import httpx
import psutil
import pytest

from tests.api.conftest import live_server
from tests.conftest import wait_for
from tests.reliability.leaks import shm_entries
from tests.reliability.procs import ServeProcess

pytestmark = pytest.mark.slow
NOFILE = 192


def _worker(server: ServeProcess) -> psutil.Process:
    return next(p for p in server.stage_workers() if p.ppid() == server.proc.pid)


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


# What a request may take on the CPU: a guard against a hang, not a latency this test claims.
# Its 2 steps run in about 0.3 s on an idle 2-core machine; with the machine's cores taken by
# other processes, a step of the tiny UNet took up to 6.5 s (a run of its default 20 steps
# took 32 s and outlived the client's 30 s).
REQUEST_S = 60
BODY = {"prompt": "a red circle", "size": "64x64", "num_inference_steps": 2}


@pytest.mark.timeout(300)  # (the sum of its bounds: two model loads and two requests, loaded)
def test_r16_a_killed_torch_worker_leaves_nothing_in_dev_shm(tmp_path_factory):
    before = shm_entries()
    # (live_server returns once the worker loaded its model, within 60 s: no request waits
    # for a load)
    with live_server(tmp_path_factory, "tiny-image") as server, server.http() as http:
        pool = server.engine.orchestrator.pools["tiny-image"][0]
        for round_ in range(2):  # a request (its progress bar), then the worker dies
            r = http.post("/v1/images/generations", json=BODY, timeout=REQUEST_S)
            assert r.status_code == 200, r.text
            if round_ == 1:
                break
            pid = pool.replicas[0].executor.pids[0]
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda p=pid: not psutil.pid_exists(p) or _zombie(p), 10, "the worker gone")
            # the restart's end, not /health alone: /health is 200 until the monitor sees the death
            wait_for(lambda: server.engine.stats.restarts == 1, 60, "the replica restarted")
            wait_for(lambda: http.get("/health").status_code == 200, 10, "the stage back")
            assert shm_entries() <= before, f"left in /dev/shm: {shm_entries() - before}"
        assert server.engine.stats.restarts == 1


def _zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
