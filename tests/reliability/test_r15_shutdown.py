"""R15 shutdown edges with the server as a real process: SIGTERM during a hanging load, and
the end of --drain-timeout (every request cut off gets an answer; video jobs are kept)."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.conftest import wait_for
from tests.reliability.procs import ServeProcess

pytestmark = pytest.mark.slow
LOAD_BOUND_S = 3.0  # SIGTERM during a load: the server is gone within this


def test_r15_sigterm_while_a_stage_load_hangs_ends_the_load_at_once(tmp_path):
    server = ServeProcess(
        ["null-image"],
        str(tmp_path),
        {"VLLM_OMNI_LIKE_FAULTS": "stage=diffusion,point=load,kind=hang"},
    )
    try:
        wait_for(lambda: server.workers(), 30, "a worker is loading")
        r = httpx.get(f"{server.url}/health", timeout=5)  # up, and says it is loading
        assert r.status_code == 503 and r.json()["status"] == "starting"
        # the worker is inside its (hanging) load, so past setting up its SIGUSR1 dump (a
        # worker still starting would die of the signal)
        wait_for(lambda: "worker hangs" in server.output(), 30, "the worker hangs in its load")
        # `kill -USR1` shows where each process is: the worker in its load, the server serving
        # (one after the other: two dumps at once interleave in the shared log)
        (worker,) = server.stage_workers()
        for pid, where in ((worker.pid, "in load"), (server.proc.pid, "in cmd_serve")):
            os.kill(pid, signal.SIGUSR1)
            wait_for(lambda w=where: w in server.output(), 5, f"the dump with {where!r}")
        assert server.proc.poll() is None and worker.is_running()  # a dump ends nothing
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait_exit(LOAD_BOUND_S + 5) == 0
        took = time.monotonic() - start
        assert took <= LOAD_BOUND_S, took
        out = server.output()
        assert "the load is stopped" in out and "Traceback" not in out, out[-3000:]
        wait_for(lambda: not server.processes(), 5, "no worker outlives the server")
    finally:
        server.cleanup()


def _sse_events(text: str) -> list[tuple[str | None, str]]:
    events = []
    for block in text.split("\n\n"):
        lines = [ln for ln in block.splitlines() if not ln.startswith(":")]
        if not lines:
            continue
        name = next((ln[7:] for ln in lines if ln.startswith("event: ")), None)
        data = next((ln[6:] for ln in lines if ln.startswith("data: ")), "")
        events.append((name, data))
    return events


def test_r15_the_drain_timeout_answers_what_it_cuts_off_and_keeps_video_jobs(tmp_path):
    drain = 2.0
    storage = str(tmp_path)
    args = ["null-image", "null-video", "--drain-timeout", str(drain), "--video-concurrency", "2"]
    server = ServeProcess(args, storage)
    results: dict[str, object] = {}
    http = httpx.Client(base_url=server.url, timeout=30)
    upload: socket.socket | None = None
    try:
        server.wait_healthy()
        short = http.post(  # 20 steps x 0.05 s: done within the drain
            "/v1/videos",
            json={"prompt": "short @delay=0.05", "seconds": "1", "num_inference_steps": 20},
        ).json()["id"]
        long = http.post(  # 100 steps x 0.1 s: cut off by it
            "/v1/videos",
            json={"prompt": "long @delay=0.1", "seconds": "1", "num_inference_steps": 100},
        ).json()["id"]
        slow = {"prompt": "slow @delay=0.1", "num_inference_steps": 100}

        def plain() -> None:
            r = httpx.post(
                f"{server.url}/v1/images/generations",
                json=slow,
                headers={"x-request-id": "cut-plain"},
                timeout=30,
            )
            results["plain"] = (r.status_code, r.headers.get("x-request-id"), r.json())
            results["plain_at"] = time.monotonic()

        def streamed() -> None:
            with httpx.stream(
                "POST",
                f"{server.url}/v1/images/generations",
                json={**slow, "stream": True},
                timeout=30,
            ) as r:
                results["stream"] = (r.status_code, r.read().decode())

        threads = [threading.Thread(target=f) for f in (plain, streamed)]
        for t in threads:
            t.start()
        # a client still sending its body when the drain ends
        upload = socket.create_connection(("127.0.0.1", server.port), timeout=15)
        upload.sendall(
            b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nX-Request-Id: cut-upload\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
        )
        wait_for(
            lambda: all(
                http.get(f"/v1/videos/{v}").json()["status"] == "in_progress" for v in (short, long)
            ),
            10,
            "both video jobs running",
        )
        wait_for(lambda: _admitted(http) >= 4, 10, "4 requests in the engine")
        sigterm_at = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        answer = b""
        while chunk := upload.recv(65536):
            answer += chunk
        upload.close()
        upload_at = time.monotonic()
        for t in threads:
            t.join(15)
        assert server.wait_exit(drain + 10) == 0
        out = server.output()
    finally:
        if upload is not None:
            upload.close()
        http.close()
        server.cleanup()
    assert "Traceback" not in out, out[-4000:]
    message = f"the server shut down before the request finished (--drain-timeout {drain:g}s)"
    # the plain request: a 503 envelope with its id, at the end of the drain
    status, request_id, body = results["plain"]
    assert status == 503 and request_id == "cut-plain", body
    assert body["error"]["code"] == "shutting_down" and body["error"]["message"] == message
    assert body["error"]["type"] == "service_unavailable"
    assert drain - 0.2 <= results["plain_at"] - sigterm_at <= drain + 3
    # the stream: an error event, then [DONE]
    status, text = results["stream"]
    events = _sse_events(text)
    assert status == 200 and events[-1] == (None, "[DONE]"), text[-500:]
    name, data = events[-2]
    assert name == "error" and json.loads(data)["error"]["code"] == "shutting_down"
    # the upload: answered by the server itself, with the client's id
    head, _, raw = data_split(answer)
    assert head.startswith("http/1.1 503") and "x-request-id: cut-upload" in head, head
    assert json.loads(raw)["error"]["message"] == message
    assert drain - 0.2 <= upload_at - sigterm_at <= drain + 3

    # the next start: the job the drain finished is there, the one it cut off runs again
    server = ServeProcess(args, storage)
    try:
        server.wait_healthy()
        with httpx.Client(base_url=server.url, timeout=30) as http:
            done = http.get(f"/v1/videos/{short}").json()
            assert done["status"] == "completed", done
            content = http.get(f"/v1/videos/{short}/content")
            assert content.status_code == 200 and content.content[4:8] == b"ftyp"
            wait_for(
                lambda: http.get(f"/v1/videos/{long}").json()["progress"] > 0,
                15,
                "the cut-off job runs again",
            )
            assert http.get(f"/v1/videos/{long}").json()["status"] == "in_progress"
    finally:
        server.cleanup()


def _admitted(http: httpx.Client) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("vllm_omni_like_requests_total "):
            return float(line.split()[1])
    return 0.0


def data_split(data: bytes) -> tuple[str, str, bytes]:
    head, sep, body = data.partition(b"\r\n\r\n")
    return head.decode("latin-1").lower(), sep.decode(), body
