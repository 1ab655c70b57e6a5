"""/health, /metrics, /version, start-up and restart behaviour of the server."""

from __future__ import annotations

import re
import sqlite3
import time

import httpx
import openai
import psutil
import pytest

from tests.api.conftest import LiveServer, live_server
from tests.conftest import wait_for, wait_until
from vllm_omni_like import __version__
from vllm_omni_like.errors import EngineDeadError


def _metric(text: str, name: str, labels: str = "") -> float:
    match = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+]+)$", text, re.M)
    assert match, f"{name}{labels} missing"
    return float(match.group(1))


def test_health_models_version(null_server):
    with null_server.http() as http:
        health = http.get("/health")
        assert health.status_code == 200
        body = health.json()
        assert body["status"] == "healthy"
        llm = next(s for s in body["stages"] if (s["pipeline"], s["name"]) == ("null-omni", "llm"))
        replicas = llm.pop("replicas")
        assert llm == {
            "pipeline": "null-omni",
            "name": "llm",
            "state": "ready",
            "replicas_live": 1,
            "replicas_total": 1,
            "restarts": 0,
        }
        (replica,) = replicas
        pids = replica.pop("pids")
        assert len(pids) == 1 and psutil.pid_exists(pids[0])  # its live worker process
        assert replica.pop("start_seconds") > 0  # (its load; a compiled one's cache, graphs)
        assert replica == {"index": 0, "device": "auto", "state": "ready", "gpu_memory_bytes": 0}
        assert http.get("/version").json() == {"version": __version__}


def test_metrics_balance_and_cover_the_engine(null_server):
    client = null_server.client(max_retries=0)
    client.images.generate(prompt="x", model="null-omni")
    with pytest.raises(openai.InternalServerError):
        client.images.generate(prompt="x @fail", model="null-image")
    with pytest.raises(openai.NotFoundError):
        client.images.generate(prompt="x", model="nope")
    assert wait_until(lambda: not null_server.engine.orchestrator.requests, 5)
    with null_server.http() as http:
        text = http.get("/metrics").text
    total = _metric(text, "vllm_omni_like_requests_total")
    finals = sum(
        _metric(text, "vllm_omni_like_requests_finished_total", f'{{status="{s}"}}')
        for s in ("success", "invalid", "error", "dead", "aborted", "timeout")
    )
    assert total == finals and total >= 2
    assert _metric(text, "vllm_omni_like_requests_finished_total", '{status="error"}') >= 1
    assert _metric(text, "vllm_omni_like_requests_rejected_total", '{status="404"}') >= 1
    for family in (
        "vllm_omni_like_requests_waiting",
        "vllm_omni_like_requests_running",
        "vllm_omni_like_replicas_alive",
        "vllm_omni_like_e2e_latency_seconds_bucket",
        "vllm_omni_like_stage_latency_seconds_bucket",
        "vllm_omni_like_batch_size_bucket",
        "vllm_omni_like_worker_deaths_total",
        "vllm_omni_like_replica_restarts_total",
        "vllm_omni_like_compiles_total",
    ):
        assert family in text
    assert 'vllm_omni_like_e2e_latency_seconds_count{pipeline="null-image",status="error"}' in text
    one = '{device="auto",pipeline="null-image",replica="0",stage="diffusion"}'
    assert _metric(text, "vllm_omni_like_replica_up", one) == 1.0
    assert _metric(text, "vllm_omni_like_replica_gpu_memory_bytes", one) == 0.0


def test_metrics_count_the_steps_run_after_an_abort(null_server):
    with null_server.http() as http:
        with pytest.raises(httpx.ReadTimeout):  # the client leaves mid-denoising
            http.post(
                "/v1/images/generations",
                json={"prompt": "x @delay=0.05", "model": "null-image", "num_inference_steps": 60},
                timeout=1.0,
            )

        def counted():
            text = http.get("/metrics").text
            return 'vllm_omni_like_steps_after_abort_count{stage="diffusion"}' in text

        wait_for(counted, 10, "the aborted batch reported")
        text = http.get("/metrics").text
    # the abort stopped the denoising at the next step boundary
    assert _metric(
        text, "vllm_omni_like_steps_after_abort_bucket", '{le="1.0",stage="diffusion"}'
    ) == _metric(text, "vllm_omni_like_steps_after_abort_count", '{stage="diffusion"}')


def test_health_says_starting_until_the_models_load(tmp_path):
    server = LiveServer(("tiny-image",), str(tmp_path)).start(ready=False)
    try:
        with httpx.Client(base_url=server.url) as http:
            first = http.get("/health")
            if not server.engine.started:  # loading takes seconds on this CPU
                assert first.status_code == 503 and first.json()["status"] == "starting"
                r = http.post("/v1/images/generations", json={"prompt": "x"})
                assert r.status_code == 503 and r.json()["error"]["code"] == "starting"
                assert r.headers["retry-after"] == "2"  # it will be ready: come back
            assert wait_until(lambda: http.get("/health").status_code == 200, 60)
            # which model family's adapter the stage runs, and through which loop each mode
            (stage,) = http.get("/health").json()["stages"]
            assert (stage["family"], stage["loop"]) == ("stable-diffusion", "own")
            assert stage["loops"] == {"text2img": "own", "edit": "own", "inpaint": "own"}
            family = [
                line
                for line in http.get("/metrics").text.splitlines()
                if line.startswith("vllm_omni_like_stage_family{")
            ]
            assert family == [  # (prometheus_client writes the labels sorted)
                'vllm_omni_like_stage_family{family="stable-diffusion",loop="own",'
                'mode="text2img",pipeline="tiny-image",stage="diffusion"} 1.0',
                'vllm_omni_like_stage_family{family="stable-diffusion",loop="own",'
                'mode="edit",pipeline="tiny-image",stage="diffusion"} 1.0',
                'vllm_omni_like_stage_family{family="stable-diffusion",loop="own",'
                'mode="inpaint",pipeline="tiny-image",stage="diffusion"} 1.0',
            ]
    finally:
        server.stop()


def test_a_stage_that_cannot_load_is_fatal(tmp_path):
    server = LiveServer(
        ("null-image",), str(tmp_path), faults="stage=diffusion,point=load,kind=raise"
    ).start(ready=False)
    try:
        assert wait_until(lambda: bool(server.fatal), 30)
        assert "stage 'diffusion'" in server.fatal[0] and "injected raise fault" in server.fatal[0]
    finally:
        server.stop()


def test_one_server_per_storage_dir(tmp_path_factory):
    with live_server(tmp_path_factory, "null-video") as first:
        second = LiveServer(("null-video",), first.settings.storage_dir)
        with pytest.raises(EngineDeadError, match="already uses the storage dir"):
            from vllm_omni_like.api.video_jobs import VideoService

            VideoService(second.engine, second.settings)


def test_video_jobs_survive_a_restart(tmp_path_factory):
    storage = str(tmp_path_factory.mktemp("storage"))
    faults = "stage=diffusion,point=execute,kind=raise,match=@fail"
    server = LiveServer(("null-video",), storage, faults=faults).start()
    client = server.client()
    done = client.videos.create_and_poll(prompt="done", seconds="1")
    failed = client.videos.create_and_poll(prompt="x @fail", seconds="1")
    server.stop()
    with open(f"{storage}/videos/{done.id}.mp4", "rb") as f:
        original = f.read()
    # as if the server had been SIGKILLed: one job mid-run, one still queued
    db = sqlite3.connect(f"{storage}/videos.db")
    params = '{"prompt": "later", "seconds": "1"}'
    for vid, status in (("video_running", "in_progress"), ("video_queued", "queued")):
        db.execute(
            "INSERT INTO videos (id, model, status, progress, created_at, seconds, size, "
            "prompt, params) VALUES (?, 'null-video', ?, 40, ?, '1', 'auto', 'later', ?)",
            (vid, status, int(time.time()), params),
        )
    db.commit()
    db.close()
    server = LiveServer(("null-video",), storage).start()
    try:
        client = server.client()
        assert {v.id for v in client.videos.list()} >= {
            done.id,
            failed.id,
            "video_running",
            "video_queued",
        }
        assert client.videos.retrieve(failed.id).status == "failed"
        running = client.videos.retrieve("video_running")
        assert running.status == "failed" and running.error.code == "server_restarted"
        assert client.videos.download_content(done.id).read() == original
        assert client.videos.poll("video_queued").status == "completed"
    finally:
        server.stop()


def test_models_lists_a_pipeline_that_makes_text_only(tmp_path_factory, tmp_path):
    """A YAML pipeline whose only stage is an LLM is a model (chat): listed, with no media
    limits, beside the image models; images asked of it are a 400."""
    spec = tmp_path / "chat.yaml"
    spec.write_text(
        "pipelines:\n"
        "  - name: chat-only\n"
        "    output: text\n"
        "    stages:\n"
        "      - {name: llm, kind: 'null', options: {output: text}}\n"
    )
    with live_server(tmp_path_factory, str(spec), "null-image") as server, server.http() as http:
        listed = http.get("/v1/models")
        assert listed.status_code == 200, listed.text
        by_id = {m["id"]: m for m in listed.json()["data"]}
        assert set(by_id) == {"chat-only", "null-image"}
        assert by_id["chat-only"]["output"] == "text" and by_id["chat-only"]["limits"] is None
        assert by_id["null-image"]["limits"]["max_side"] > 0
        one = http.get("/v1/models/chat-only")
        assert one.status_code == 200 and one.json()["stages"] == ["llm"]
        assert server.client().models.retrieve("chat-only").id == "chat-only"
        r = http.post("/v1/images/generations", json={"prompt": "x", "model": "chat-only"})
        assert r.status_code == 400, r.text


@pytest.mark.slow
def test_health_and_models_say_each_stages_precision(tmp_path_factory):
    """A stage's workers say at start what its model computes in: `quantization: fp8` on the
    tiny Wan model (its transformer's linear layers FP8), on /health and on the model's
    /v1/models entry (a stage without it says its weights' dtype: fp32, bf16, ...)."""
    with (
        live_server(tmp_path_factory, "tiny-video", stage_kw={"quantization": "fp8"}) as server,
        server.http() as http,
    ):
        (stage,) = http.get("/health").json()["stages"]
        assert (stage["name"], stage["precision"]) == ("diffusion", "fp8")
        assert http.get("/v1/models/tiny-video").json()["precision"] == {"diffusion": "fp8"}
        models = http.get("/v1/models").json()["data"]
        assert [m["precision"] for m in models] == [{"diffusion": "fp8"}]


@pytest.mark.slow
def test_health_says_each_stages_step_cache_and_a_video_sends_its_own_threshold(
    tmp_path_factory,
):
    """`--cache first-block` on the tiny Wan model: /health names the stage's cache (mode,
    threshold, decision; a stage without one says null), and a video request's own
    `"cache": {"threshold": T}` runs (a negative one is a 400 before anything is queued)."""
    kw = {"cache": "first-block", "cache_threshold": 0.1}
    with live_server(tmp_path_factory, "tiny-video", stage_kw=kw) as server, server.http() as h:
        (stage,) = h.get("/health").json()["stages"]
        assert stage["cache"] == {"mode": "first-block", "threshold": 0.1, "decision": "lagged"}
        body = {"prompt": "a red circle", "seconds": "1", "num_inference_steps": 4}
        bad = h.post("/v1/videos", json={**body, "cache": {"threshold": -1}})
        assert bad.status_code == 400 and "threshold" in bad.text
        job = h.post("/v1/videos", json={**body, "cache": {"threshold": 0.3}})
        assert job.status_code == 200, job.text
        video = server.client().videos.poll(job.json()["id"])
        assert video.status == "completed", video.error
