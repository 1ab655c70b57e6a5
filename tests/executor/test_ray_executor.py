"""The Ray executor on a local cluster of two simulated nodes (null stages: no torch).

One cluster for the module (tests/ray_cluster.py). After each test: no actor of ours alive, no
placement group left, no actor process."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import time

import pytest

from tests import ray_cluster
from tests.conftest import drain_batch, wait_until
from tests.engine.helpers import engine, final, req
from tests.ray_cluster import MISSING, ours_alive, two_nodes
from vllm_omni_like.config import StageConfig
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.wire import BatchDone, ExecuteBatch, Progress, RequestResult, StageRequest

pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")


@pytest.fixture(scope="module")
def cluster():
    with two_nodes() as c:
        yield c


@pytest.fixture
def nothing_left(cluster):
    yield cluster
    ray_cluster.nothing_left()


def _req(rid: str, steps: int = 2, delay: float = 0.0) -> StageRequest:
    return StageRequest(
        rid, "a cat", GenerationParams(seed=1, num_inference_steps=steps, step_delay=delay)
    )


def _started(config: StageConfig):
    from vllm_omni_like.executor.ray_executor import RayExecutor

    sink: queue.Queue = queue.Queue()
    ex = RayExecutor(config, 0, sink.put)
    deaths: list = []
    ex.add_failure_callback(deaths.append)
    ex.start()
    return ex, sink, deaths


def test_a_batch_runs_on_an_actor_and_a_killed_actor_is_a_death_within_a_second(nothing_left):
    ex, sink, deaths = _started(StageConfig(name="diffusion", kind="null"))
    try:
        ex.execute(ExecuteBatch(1, [_req("a"), _req("b")]))
        msgs = drain_batch(sink, 1, timeout=20)
        results = {m.output.request_id: m.output for m in msgs if isinstance(m, RequestResult)}
        assert sorted(results) == ["a", "b"] and results["a"].images[0].pixels.shape == (
            64,
            64,
            3,
        )
        assert any(isinstance(m, Progress) for m in msgs) and ex.in_flight == set()
        ex.execute(ExecuteBatch(2, [_req("slow", steps=100, delay=0.05)]))
        assert isinstance(sink.get(timeout=10), Progress)  # it runs
        (pid,) = ex.pids
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        assert wait_until(lambda: deaths, 5)
        assert time.monotonic() - t0 < 1.0
        (death,) = deaths
        assert death.in_flight == ["slow"] and "ActorDiedError" in death.exit_desc
        assert not ex.alive
    finally:
        ex.shutdown()


def test_an_abort_reaches_the_actor_during_its_batch(nothing_left):
    ex, sink, deaths = _started(StageConfig(name="diffusion", kind="null"))
    try:
        ex.execute(ExecuteBatch(1, [_req("long", steps=200, delay=0.02)]))
        assert isinstance(sink.get(timeout=10), Progress)
        t0 = time.monotonic()
        ex.abort(["long"])
        msgs = drain_batch(sink, 1, timeout=10)
        done = next(m for m in msgs if isinstance(m, BatchDone))
        assert time.monotonic() - t0 < 2.0
        assert done.steps_run["long"] < 200 and done.steps_after_abort["long"] <= 1
        assert [m.output.request_id for m in msgs if isinstance(m, RequestResult)] == []
        assert deaths == []
    finally:
        ex.shutdown()


@pytest.mark.drill  # (a second Ray node started and lost: ~10 s)
def test_a_lost_node_under_load_reroutes_its_requests_and_the_replica_comes_back(cluster):
    """Two replicas, one on each node; the second node removed without grace while requests
    run: none fails or hangs, the live replica takes them, the lost one restarts once a node
    has room again."""
    kw = {"replicas": 2, "max_batch_size": 4}
    with engine("null-image", stage_kw=kw, executor="ray", max_request_retries=2) as e:
        nodes = {a["Address"]["NodeID"] for a in ours_alive()}
        assert len(nodes) == 2  # one CPU a node: a replica on each

        async def load():
            jobs = [
                final(e, req(f"r{i}", pipeline="null-image", steps=20, delay=0.05))
                for i in range(12)
            ]
            return await asyncio.gather(*jobs)

        async def scenario():
            running = asyncio.ensure_future(load())
            await asyncio.sleep(0.6)  # batches on both replicas
            worker = next(n for n in cluster.list_all_nodes() if n is not cluster.head_node)
            await asyncio.to_thread(cluster.remove_node, worker, False)
            t0 = time.monotonic()
            while e.stats.snapshot()["worker_deaths"] < 1 and time.monotonic() - t0 < 10:
                await asyncio.sleep(0.02)
            seen = time.monotonic() - t0
            outs = await asyncio.wait_for(running, 60)
            return outs, seen, time.monotonic() - t0

        outs, seen, took = asyncio.run(scenario())
        # found by the health checks (3 x 200 ms here), not by a timeout of ours
        print(f"node loss seen after {seen:.2f}s, requests done {took:.2f}s after the removal")
        assert e.stats.snapshot()["worker_deaths"] == 1 and seen < 3.0, seen
        assert all(o.ok for o in outs), [o.error for o in outs if not o.ok]
        assert took < 30
        cluster.add_node(num_cpus=1)
        stage = e.health()[0]
        assert wait_until(lambda: e.health()[0]["replicas_live"] == 2, 60), stage
        assert asyncio.run(final(e, req("after", pipeline="null-image"))).ok
    ray_cluster.nothing_left()  # (the engine's shutdown left the cluster: back, to look)


def test_a_tiny_model_serves_through_ray(nothing_left, capfd):
    """Torch in the actor: the embedded tiny image model, its image back through the object
    store; the worker's log lines reach the server's output, named after the actor."""
    seen = ""

    def worker_logged() -> bool:
        nonlocal seen
        seen += "".join(capfd.readouterr())
        return "(WorkerActor pid=" in seen and "stage diffusion: attention" in seen

    with engine("tiny-image", executor="ray") as e:
        out = asyncio.run(final(e, req("t", "a red circle", pipeline="tiny-image", steps=4)))
        assert out.ok, out.error
        (image,) = out.output.images
        assert image.pixels.shape == (64, 64, 3) and image.pixels.std() > 0
        assert wait_until(worker_logged, 10), seen[-2000:]
