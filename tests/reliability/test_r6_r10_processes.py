"""R6-R10 with the server as a real process: start-up failures, SIGKILL, SIGTERM, restarts."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.conftest import wait_until
from tests.reliability.leaks import Baseline, shm_entries
from tests.reliability.procs import ServeProcess

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (
            ["tests/reliability/bad_model.yaml"],
            {},
            ["stage 'diffusion'", "model directory '/nonexistent/sd' does not exist"],
        ),
        (
            ["null-omni"],
            {"VLLM_OMNI_LIKE_FAULTS": "stage=llm,point=load,kind=raise"},
            ["stage 'llm'", "injected raise fault at load"],
        ),
        (
            ["null-omni"],
            {"VLLM_OMNI_LIKE_FAULTS": "stage=diffusion,point=load,kind=exit"},
            ["stage 'diffusion'", "worker 0 exited with code 86 while loading"],
        ),
    ],
)
def test_r6_startup_failures_exit_non_zero_naming_stage_and_cause(tmp_path, args, env, expected):
    server = ServeProcess(args, str(tmp_path), env)
    try:
        code = server.wait_exit(30)
        out = server.output()
        assert code != 0
        assert all(e in out for e in expected), out[-2000:]
        assert wait_until(lambda: not server.processes(), 5), "orphans left"
    finally:
        server.cleanup()


def test_r6_unknown_model_is_refused_before_anything_starts(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_omni_like.cli",
            "serve",
            "/nope/model",
            "--storage-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 2 and "unknown model '/nope/model'" in out.stderr


def test_r7_sigkill_of_the_server_takes_its_workers_along(tmp_path):
    shm = shm_entries()
    server = ServeProcess(["null-omni", "null-video", "--replicas", "2"], str(tmp_path))
    try:
        server.wait_healthy()
        workers = server.stage_workers()
        assert len(workers) == 6  # 3 stages x 2 replicas
        httpx.post(f"{server.url}/v1/images/generations", json={"prompt": "x"}, timeout=10)
        server.proc.kill()
        t0 = time.monotonic()
        assert wait_until(lambda: not server.processes(), 10), server.processes()
        assert time.monotonic() - t0 < 10
        assert shm_entries() <= shm
    finally:
        server.cleanup()


def test_r8_sigterm_under_load_drains_and_exits_zero(tmp_path):
    base = Baseline()
    server = ServeProcess(["null-image", "--drain-timeout", "20"], str(tmp_path))
    try:
        server.wait_healthy()
        workers = server.workers()
        results = []

        def slow():
            r = httpx.post(
                f"{server.url}/v1/images/generations",
                timeout=30,
                json={"prompt": "x @delay=0.05", "num_inference_steps": 30},
            )
            results.append(r.status_code)

        threads = [threading.Thread(target=slow) for _ in range(6)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:
            late = httpx.post(
                f"{server.url}/v1/images/generations", json={"prompt": "x"}, timeout=5
            ).status_code
        except httpx.TransportError:
            late = "refused"
        for t in threads:
            t.join(30)
        assert results == [200] * 6  # in-flight work finished
        assert late in ("refused", 503)
        assert server.wait_exit(30) == 0
        assert wait_until(
            lambda: not any(w.is_running() and w.status() != "zombie" for w in workers), 10
        )
    finally:
        server.cleanup()
    base.check(fd_slack=10)


def test_r9_schemathesis_finds_no_server_error(tmp_path):
    server = ServeProcess(
        [
            "null-omni",
            "null-video",
            "--max-pixels",
            "65536",
            "--max-side",
            "256",
            "--max-frames",
            "17",
        ],
        str(tmp_path),
    )
    try:
        server.wait_healthy()
        out = subprocess.run(
            [
                "schemathesis",
                "run",
                f"{server.url}/openapi.json",
                "--checks",
                "not_a_server_error",
                "--max-examples",
                "30",
                "--seed",
                "9",
                "--workers",  # one: hypothesis describes strategies with ast.parse, which in
                "1",  # threads can raise "AST constructor recursion depth mismatch" (CPython
                # gh-106905; once in a clean-clone run here on 3.11.7 with two workers)
                "--max-time",
                "8",
                "--phases",
                "examples,coverage,fuzzing",
            ],
            capture_output=True,
            text=True,
            timeout=150,
        )
        assert out.returncode == 0, out.stdout[-4000:]
        assert "test cases" in out.stdout or "passed" in out.stdout
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 200, health.text
    finally:
        server.cleanup()


# a drill (the suite's time): the same outcomes in-process, tests/api/test_health.py's
# test_video_jobs_survive_a_restart; here a real SIGKILL of a server running a torch job
@pytest.mark.drill
def test_r10_video_jobs_across_a_sigkill(tmp_path):
    storage = str(tmp_path)
    args = ["tiny-video", "--video-concurrency", "1"]
    faults = {"VLLM_OMNI_LIKE_FAULTS": "stage=diffusion,point=execute,kind=raise,match=@fail"}
    server = ServeProcess(args, storage, faults)
    try:
        server.wait_healthy()
        with httpx.Client(base_url=server.url, timeout=30) as http:

            def create(prompt="a red square moving left", **body):
                return http.post(
                    "/v1/videos", json={"prompt": prompt, "seconds": "1", **body}
                ).json()["id"]

            done = create(num_inference_steps=2)
            assert wait_until(
                lambda: http.get(f"/v1/videos/{done}").json()["status"] == "completed", 60
            )
            failed = create("a red square moving left @fail")  # fails inside the stage
            assert wait_until(
                lambda: http.get(f"/v1/videos/{failed}").json()["status"] == "failed", 30
            )
            running = create(num_inference_steps=200, num_frames=33)
            queued = create(num_inference_steps=2)
            assert wait_until(
                lambda: http.get(f"/v1/videos/{running}").json()["status"] == "in_progress", 30
            )
            original = http.get(f"/v1/videos/{done}/content").content
        server.proc.kill()
        server.proc.wait(10)
        assert wait_until(lambda: not server.processes(), 10)
        server.cleanup()

        server = ServeProcess(args, storage, faults)
        server.wait_healthy()
        with httpx.Client(base_url=server.url, timeout=30) as http:
            listed = {
                v["id"]: v for v in http.get("/v1/videos", params={"limit": 10}).json()["data"]
            }
            assert set(listed) == {done, failed, running, queued}
            assert listed[done]["status"] == "completed"
            assert http.get(f"/v1/videos/{done}/content").content == original
            assert listed[failed]["status"] == "failed"
            assert listed[running]["status"] == "failed"
            assert listed[running]["error"]["code"] == "server_restarted"
            assert wait_until(
                lambda: http.get(f"/v1/videos/{queued}").json()["status"] == "completed", 60
            )
    finally:
        server.cleanup()
