"""R1-R4: recoverable faults under load, worker kills, re-routing, poison requests, hangs."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import threading
import time

import httpx
import numpy as np
import pytest

from tests.api.conftest import live_server
from tests.conftest import wait_for, wait_until
from tests.reliability.leaks import Baseline, check_engine
from vllm_omni_like.config import parse_faults
from vllm_omni_like.stages.faults import selects
from vllm_omni_like.wire import StageRequest

R1_FAULTS = (
    "stage=llm,point=execute,kind=raise,p=0.02,seed=11;"
    "stage=llm,point=step,kind=invalid,p=0.02,seed=12;"
    "stage=diffusion,point=execute,kind=oom,p=0.02,seed=13;"
    "stage=diffusion,point=step,kind=raise,p=0.02,seed=14;"
    "stage=diffusion,point=output,kind=invalid,p=0.02,seed=15"
)
ORDER = [(s, p) for s in ("llm", "diffusion") for p in ("execute", "step", "output")]


def expected_fault(rules, rid: str, prompt: str):
    """The first rule that fires on this request's way through the stages, if any."""
    probe = StageRequest(rid, prompt)
    for stage, point in ORDER:
        for rule in rules:
            if (rule.stage, rule.point) == (stage, point) and selects(rule, probe):
                return rule
    return None


async def _drive(url: str, bodies: list[tuple[str, dict]], concurrency: int):
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:

        async def one(rid, body):
            async with gate:
                return rid, await http.post(
                    "/v1/images/generations", json=body, headers={"x-request-id": rid}
                )

        return dict(await asyncio.gather(*(one(rid, b) for rid, b in bodies)))


def test_r1_recoverable_faults_under_load(tmp_path_factory):
    base = Baseline()
    rules = parse_faults(R1_FAULTS)
    with live_server(
        tmp_path_factory, "null-omni", faults=R1_FAULTS, engine_kw={"max_queue_size": 1000}
    ) as server:
        bodies = [
            (
                f"r1-{i}",
                {
                    "prompt": f"prompt {i} @delay=0.002",
                    "seed": i,
                    "num_inference_steps": 3,
                    "model": "null-omni",
                },
            )
            for i in range(500)
        ]
        t0 = time.monotonic()
        got = asyncio.run(_drive(server.url, bodies, 16))
        assert time.monotonic() - t0 < 120
        faulted = ok = 0
        for rid, body in bodies:
            r = got[rid]
            rule = expected_fault(rules, rid, body["prompt"])
            if rule is None:
                assert r.status_code == 200, r.text
                ok += 1
                continue
            faulted += 1
            assert r.status_code == (400 if rule.kind == "invalid" else 500), (rid, rule, r.text)
            err = r.json()["error"]
            assert err["stage"] == rule.stage and err["message"].startswith(f"stage '{rule.stage}'")
        assert 30 <= faulted <= 80 and ok + faulted == 500
        wait_for(  # faulted peers shared batches (counted at each BatchDone)
            lambda: (
                max(k for k, v in server.engine.stats.snapshot()["batch_sizes"].items() if v) > 1
            ),
            5,
            "a batch of more than one",
        )
        # the survivors equal a fault-free run of the same seeds (ids chosen to hit no rule)
        refs = []
        for rid, body in bodies:
            if got[rid].status_code == 200:
                ref_id = next(
                    f"ref{k}-{rid}"
                    for k in range(100)
                    if expected_fault(rules, f"ref{k}-{rid}", body["prompt"]) is None
                )
                refs.append((ref_id, body, rid))
        again = asyncio.run(_drive(server.url, [(r, b) for r, b, _ in refs], 16))
        for ref_id, _, rid in refs:
            assert again[ref_id].json()["data"] == got[rid].json()["data"]
        assert httpx.get(f"{server.url}/health").status_code == 200
        check_engine(server)
    base.check(fd_slack=10)


# (the suite's time: -m drill; the same faults under load on null stages run by default)
@pytest.mark.drill
def test_r1_share_on_the_tiny_model(tmp_path_factory):
    faults = "stage=diffusion,point=step,kind=raise,p=0.1,seed=21"
    rules = parse_faults(faults)
    with live_server(tmp_path_factory, "tiny-image", faults=faults) as server:
        bodies = [
            (f"t1-{i}", {"prompt": f"a red circle {i % 5}", "seed": i, "num_inference_steps": 3})
            for i in range(40)
        ]
        got = asyncio.run(_drive(server.url, bodies, 16))
        for rid, body in bodies:
            rule = expected_fault(rules, rid, body["prompt"])
            assert got[rid].status_code == (200 if rule is None else 500)
        rid, body = next((r, b) for r, b in bodies if got[r].status_code == 200)
        alone = httpx.post(
            f"{server.url}/v1/images/generations",
            json=body,
            headers={"x-request-id": "t1-ref-0"},
            timeout=60,
        ).json()
        a = _pixels(alone["data"][0]["b64_json"])
        b = _pixels(got[rid].json()["data"][0]["b64_json"])
        # same seed alone vs inside a batch: CPU kernels differ by batch size, by rounding only
        assert np.abs(a - b).max() <= 2
        assert httpx.get(f"{server.url}/health").status_code == 200


def _pixels(b64: str) -> np.ndarray:
    from io import BytesIO

    from PIL import Image

    return np.asarray(Image.open(BytesIO(base64.b64decode(b64)))).astype(int)


def _kill(server, pipeline: str, stage: int, replica: int = 0, sig=signal.SIGKILL) -> None:
    pool = server.engine.orchestrator.pools[pipeline][stage]
    os.kill(pool.replicas[replica].executor.pids[0], sig)


def _in_flight(server, n: int, body: dict) -> tuple[list, list[threading.Thread]]:
    results: list = []

    def one(i):
        with httpx.Client(base_url=server.url, timeout=60) as http:
            t = time.monotonic()
            r = http.post("/v1/images/generations", json=body)
            results.append((r, time.monotonic() - t, time.monotonic()))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return results, threads


SLOW = {"prompt": "x @delay=0.03", "num_inference_steps": 60, "model": "null-image"}


def test_r2_only_worker_killed_without_restarts(tmp_path_factory):
    base = Baseline()
    with live_server(tmp_path_factory, "null-image", engine_kw={"max_restarts": 0}) as server:
        results, threads = _in_flight(server, 16, SLOW)
        assert wait_until(lambda: len(server.engine.orchestrator.requests) == 16, 5)
        time.sleep(0.2)
        killed = time.monotonic()
        _kill(server, "null-image", 0)
        for t in threads:
            t.join(10)
        assert len(results) == 16
        for r, _, done in results:
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
            assert done - killed < 2
        assert httpx.get(f"{server.url}/health").status_code == 503
        t0 = time.monotonic()
        assert (
            httpx.post(f"{server.url}/v1/images/generations", json={"prompt": "x"}).status_code
            == 503
        )
        assert time.monotonic() - t0 < 0.5
    base.check(fd_slack=10)


def killed_worker_reruns(server, n: int, ready_within: float) -> None:
    """R2 with restarts: the only worker SIGKILLed with `n` requests in flight; /health says
    restarting within 2 s, every request re-runs to a 200, the stage is ready again within
    `ready_within` seconds and nothing is left behind (the Ray battery runs it too)."""
    results, threads = _in_flight(server, n, {**SLOW, "num_inference_steps": 30})
    assert wait_until(lambda: len(server.engine.orchestrator.requests) == n, 5)
    time.sleep(0.2)
    killed = time.monotonic()
    _kill(server, "null-image", 0)
    assert wait_until(lambda: httpx.get(f"{server.url}/health").json()["status"] == "restarting", 2)
    assert time.monotonic() - killed < 2
    for t in threads:
        t.join(30)
    assert [r.status_code for r, _, _ in results] == [200] * n  # re-run, within deadline
    assert wait_until(lambda: httpx.get(f"{server.url}/health").status_code == 200, ready_within)
    check_engine(server)


def test_r2_only_worker_killed_with_restarts(tmp_path_factory):
    base = Baseline()
    with live_server(tmp_path_factory, "null-image", engine_kw={"max_restarts": 2}) as server:
        killed_worker_reruns(server, 16, ready_within=10)
    base.check(fd_slack=10)


@pytest.mark.parametrize(
    "placement",
    [{"replicas": 2}, {"devices": ("cuda:0", "cuda:1")}],  # null stages never touch the GPUs
    ids=["replicas", "devices"],
)
def test_r3_two_replicas_reroute_and_poison(tmp_path_factory, placement):
    base = Baseline()
    faults = "stage=diffusion,point=step,kind=exit,match=@poison"
    with live_server(
        tmp_path_factory,
        "null-omni",
        faults=faults,
        stage_kw=placement,
        engine_kw={"max_restarts": 5},
    ) as server:
        stats = server.engine.stats
        body = {"prompt": "x @delay=0.03", "num_inference_steps": 30, "model": "null-omni"}
        results, threads = _in_flight(server, 8, body)
        pool = server.engine.orchestrator.pools["null-omni"][1]
        assert wait_until(lambda: pool.replicas[0].critical is not None, 10)
        health = []
        watcher = threading.Thread(
            target=lambda: [
                health.append(httpx.get(f"{server.url}/health").status_code) or time.sleep(0.02)
                for _ in range(40)
            ]
        )
        watcher.start()
        _kill(server, "null-omni", 1, replica=0)
        for t in threads:
            t.join(30)
        watcher.join()
        assert [r.status_code for r, _, _ in results] == [200] * 8
        assert stats.stage_requests["llm"] == 8  # the LLM stage was not run again
        assert set(health) == {200}  # the other replica kept the stage ready
        wait_for(lambda: pool.live_count == 2, 10, "the killed replica restarted")
        if "devices" in placement:  # each replica came back on its own GPU
            assert [r.executor.visible_devices for r in pool.replicas] == ["0", "1"]
        deaths = stats.worker_deaths  # read once the restart (after the death) is seen
        r = httpx.post(
            f"{server.url}/v1/images/generations",
            timeout=30,
            json={"prompt": "x @poison", "model": "null-omni"},
        )
        assert r.status_code == 500
        assert r.json()["error"]["message"] == (
            "stage 'diffusion': request crashed the worker twice; it is not retried"
        )
        wait_for(lambda: stats.worker_deaths - deaths == 2, 5, "the poison's two deaths")
        assert wait_until(lambda: httpx.get(f"{server.url}/health").status_code == 200, 10)
        check_engine(server)
    base.check(fd_slack=10)


def stopped_worker_reruns(server) -> None:
    """R4: the only worker SIGSTOPped after its first steps (a hang mid-run; the first step
    has its own bound): the stall detector kills it, its 4 requests re-run to a 200, the stall
    counts as one death and nothing is left behind (the Ray battery runs it too)."""
    results, threads = _in_flight(server, 4, {**SLOW, "num_inference_steps": 20})
    replica = server.engine.orchestrator.pools["null-image"][0].replicas[0]
    wait_for(lambda: replica.critical is not None and replica.clock.speed.rate, 5, "a step")
    _kill(server, "null-image", 0, sig=signal.SIGSTOP)
    for t in threads:
        t.join(30)
    assert [r.status_code for r, _, _ in results] == [200] * 4
    wait_for(lambda: server.engine.stats.worker_deaths == 1, 5, "the stall counted as a death")
    check_engine(server)


def test_r4_stopped_worker_is_killed_and_its_work_rerun(tmp_path_factory):
    base = Baseline()
    with live_server(
        tmp_path_factory,
        "null-image",
        stage_kw={"stall_timeout": 1.0},
        engine_kw={"max_restarts": 2, "request_timeout": 20},
    ) as server:
        stopped_worker_reruns(server)
    base.check(fd_slack=10)


@pytest.mark.parametrize(
    ("stall", "status", "deadline"),
    [(1.0, 500, 4.0), (30.0, 504, 2.0)],  # the stall detector within the deadline, or not
)
def test_r4_hang_fault_ends_within_the_deadline(tmp_path_factory, stall, status, deadline):
    faults = "stage=diffusion,point=step,kind=hang,match=@hang"
    with live_server(
        tmp_path_factory,
        "null-image",
        faults=faults,
        stage_kw={"stall_timeout": stall, "cold_step_timeout": stall},
        engine_kw={"max_restarts": 3, "request_timeout": deadline},
    ) as server:
        t0 = time.monotonic()
        r = httpx.post(
            f"{server.url}/v1/images/generations",
            timeout=30,
            json={"prompt": "x @hang", "model": "null-image"},
        )
        assert r.status_code == status
        assert time.monotonic() - t0 < deadline + 1.5  # never past its deadline
