"""Outputs that cannot be stored (the `store` fault point; a real full tmpfs where root may
mount one), video jobs created while their stage restarts, and jobs waiting for engine room."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import psutil
import pytest

from tests.api.conftest import LiveServer, live_server
from tests.conftest import wait_for
from vllm_omni_like.engine import stage_pool

STORE_FAULTS = (
    "stage=videos,point=store,kind=enospc,match=@full;"
    "stage=files,point=store,kind=enospc,match=@full;"
    "stage=videos,point=store,kind=raise,match=@broken"
)


@pytest.fixture(scope="module")
def store_server(tmp_path_factory):
    with live_server(tmp_path_factory, "null-image", "null-video", faults=STORE_FAULTS) as s:
        yield s


def _final(server) -> dict[str, int]:
    return dict(server.engine.stats.snapshot()["final"])


def _job(http, video_id: str) -> dict:
    return http.get(f"/v1/videos/{video_id}").json()


def _ended(http, video_id: str, seen: set | None = None) -> dict:
    """The job once it completed or failed (within 15 s); `seen` collects the states polled."""

    def ended():
        job = _job(http, video_id)
        if seen is not None:
            seen.add(job["status"])
        return job["status"] in ("completed", "failed") and job

    return wait_for(ended, 15, f"{video_id} to end")


def _media_files(server) -> list[str]:
    return os.listdir(os.path.join(server.settings.storage_dir, "videos"))


def test_a_video_that_cannot_be_written_fails_and_counts_as_an_error(store_server):
    before = _final(store_server)
    with store_server.http() as http:
        vid = http.post("/v1/videos", json={"prompt": "a dot @full", "seconds": "1"}).json()["id"]
        job = _ended(http, vid)
        assert job["status"] == "failed", job
        assert job["error"]["code"] == "storage_error"
        assert job["error"]["message"].startswith(
            "the video was made but could not be stored: No space left on device (injected "
            f"enospc fault at store for request {vid}"
        )
        assert job["progress"] < 100 and job["completed_at"] is not None
        content = http.get(f"/v1/videos/{vid}/content")
        assert content.status_code == 422 and content.json()["error"]["code"] == "video_failed"
        ok = http.post("/v1/videos", json={"prompt": "a dot", "seconds": "1"}).json()["id"]
        wait_for(lambda: _job(http, ok)["status"] == "completed", 15, "a clean job completes")
    assert not [f for f in _media_files(store_server) if f.startswith(vid)]  # no partial file
    after = _final(store_server)
    assert after["error"] == before["error"] + 1 and after["success"] == before["success"] + 1
    snap = store_server.engine.stats.snapshot()
    assert sum(snap["final"].values()) == snap["requests_total"]


def test_any_other_write_failure_fails_the_job_too(store_server):
    with store_server.http() as http:
        vid = http.post("/v1/videos", json={"prompt": "x @broken", "seconds": "1"}).json()["id"]
        job = _ended(http, vid)
    assert job["status"] == "failed" and job["error"]["code"] == "storage_error"
    assert "InjectedFault: injected raise fault at store" in job["error"]["message"]


def test_an_image_url_that_cannot_be_written_is_a_500_counted_as_an_error(store_server):
    before = _final(store_server)
    with store_server.http() as http:
        r = http.post(
            "/v1/images/generations",
            json={"prompt": "a dot @full", "response_format": "url"},
        )
        assert r.status_code == 500 and r.headers["x-should-retry"] == "false"
        error = r.json()["error"]
        assert error["code"] == "storage_error" and error["type"] == "server_error"
        assert error["message"].startswith(
            "the image was made but could not be stored: No space left on device"
        )
        b64 = http.post("/v1/images/generations", json={"prompt": "a dot @full"})
        assert b64.status_code == 200  # nothing is written for b64_json
        url = http.post(
            "/v1/images/generations", json={"prompt": "a dot", "response_format": "url"}
        )
        assert url.status_code == 200 and http.get(url.json()["data"][0]["url"]).status_code == 200
    after = _final(store_server)
    assert after["error"] == before["error"] + 1 and after["success"] == before["success"] + 2
    assert os.listdir(os.path.join(store_server.settings.storage_dir, "images")) == [
        url.json()["data"][0]["url"].rsplit("/", 1)[1]
    ]


def test_a_full_tmpfs_fails_the_job(tmp_path_factory):
    """The real thing: a 1 MiB tmpfs filled to the brim (root only; elsewhere the `store`
    fault point above tests the same path)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path_factory.mktemp("tiny-tmpfs")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        storage = tmp_path_factory.mktemp("storage")
        os.symlink(str(mount), str(storage / "videos"))  # the video files go to the tmpfs
        filler = os.path.join(str(mount), "filler")
        with open(filler, "wb") as f, contextlib.suppress(OSError):  # until the tmpfs is full
            f.write(b"\0" * (2 << 20))
        server = LiveServer(("null-video",), str(storage)).start()
        try:
            with server.http() as http:
                vid = http.post("/v1/videos", json={"prompt": "x", "seconds": "1"}).json()["id"]
                job = _ended(http, vid)
        finally:
            server.stop()
        assert job["status"] == "failed" and job["error"]["code"] == "storage_error"
        assert "No space left on device" in job["error"]["message"]
        assert os.listdir(str(mount)) == ["filler"]  # no partial file left
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_job_created_while_its_stage_restarts_waits_for_it(tmp_path_factory, monkeypatch):
    monkeypatch.setattr(stage_pool, "RESTART_BACKOFF_S", (0.5,))
    with live_server(tmp_path_factory, "null-video") as server, server.http() as http:
        pool = server.engine.orchestrator.pools["null-video"][0]
        os.kill(pool.replicas[0].executor.pids[0], signal.SIGKILL)
        wait_for(lambda: pool.state == "restarting", 5, "the stage restarting")
        vid = http.post("/v1/videos", json={"prompt": "x", "seconds": "1"}).json()["id"]
        seen = set()

        job = _ended(http, vid, seen)
        assert job["status"] == "completed", job
        assert "queued" in seen and "failed" not in seen
        assert server.engine.stats.restarts == 1


def test_jobs_waiting_for_engine_room_cost_no_cpu(tmp_path_factory):
    with (
        live_server(
            tmp_path_factory,
            "null-video",
            engine_kw={"max_queue_size": 1},
            settings_kw={"video_concurrency": 4},
        ) as server,
        server.http() as http,
    ):
        # the first runs 2.5 s, through the measurement; the two after it wait, then are quick
        body = {"prompt": "x @delay=0.1", "seconds": "1"}
        ids = [
            http.post("/v1/videos", json={**body, "num_inference_steps": n}).json()["id"]
            for n in (25, 2, 2)
        ]
        wait_for(lambda: _job(http, ids[0])["status"] == "in_progress", 10, "one job running")
        me = psutil.Process()
        cpu0, t0 = sum(me.cpu_times()[:2]), time.monotonic()
        time.sleep(1.5)  # the other two wait for room in the engine (its queue holds one)
        used = (sum(me.cpu_times()[:2]) - cpu0) / (time.monotonic() - t0)
        assert [_job(http, v)["status"] for v in ids[1:]] == ["queued", "queued"]
        assert used < 0.25, f"waiting jobs used {used:.0%} of a core"
        for vid in ids:  # and they all run in turn
            wait_for(lambda v=vid: _job(http, v)["status"] == "completed", 30, f"{vid} completes")
