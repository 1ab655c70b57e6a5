"""R2, R3, R4 and R7 with `--executor ray`, on a local cluster of two simulated nodes (node loss
is in tests/executor/test_ray_executor.py). The same scenarios and bounds as with processes;
the leak checks look through Ray (tests/ray_cluster.py) and exclude the cluster's own processes.
"""

from __future__ import annotations

import time

import httpx
import pytest

from tests import ray_cluster
from tests.api.conftest import live_server
from tests.conftest import wait_for, wait_until
from tests.ray_cluster import MISSING, actor_processes, two_nodes
from tests.reliability.leaks import check_engine
from tests.reliability.procs import ServeProcess
from tests.reliability.test_r1_r4_faults import (
    SLOW,
    _in_flight,
    _kill,
    killed_worker_reruns,
    stopped_worker_reruns,
)

# a drill (`pytest -m drill`): the same batteries run over processes in the default run, and
# the Ray executor's own deaths, lost node and serving are in tests/executor/test_ray_executor.py
pytestmark = [pytest.mark.skipif(MISSING is not None, reason=MISSING or ""), pytest.mark.drill]
RAY = {"executor": "ray"}


@pytest.fixture(scope="module")
def cluster():
    with two_nodes(cpus=2) as c:
        yield c


@pytest.fixture
def ray_leaks(cluster):
    yield cluster
    ray_cluster.nothing_left()


def test_r2_killed_actor_reruns_its_requests(tmp_path_factory, ray_leaks):
    with live_server(tmp_path_factory, "null-image", engine_kw={**RAY, "max_restarts": 2}) as s:
        killed_worker_reruns(s, 8, ready_within=15)


def test_r3_two_replicas_reroute_and_poison(tmp_path_factory, ray_leaks):
    faults = "stage=diffusion,point=step,kind=exit,match=@poison"
    with live_server(
        tmp_path_factory,
        "null-image",
        faults=faults,
        stage_kw={"replicas": 2},
        engine_kw={**RAY, "max_restarts": 5},
    ) as s:
        stats = s.engine.stats
        results, threads = _in_flight(s, 8, SLOW | {"num_inference_steps": 30})
        pool = s.engine.orchestrator.pools["null-image"][0]
        busy = lambda: [r.index for r in pool.replicas if r.critical is not None]  # noqa: E731
        assert wait_until(busy, 10)
        _kill(s, "null-image", 0, replica=busy()[0])
        health = [httpx.get(f"{s.url}/health").status_code for _ in range(10)]
        for t in threads:
            t.join(30)
        assert [r.status_code for r, _, _ in results] == [200] * 8
        assert set(health) == {200}  # the other replica kept the stage ready
        wait_for(lambda: pool.live_count == 2, 15, "the killed replica restarted")
        deaths = stats.worker_deaths
        r = httpx.post(f"{s.url}/v1/images/generations", timeout=30, json={"prompt": "x @poison"})
        assert r.status_code == 500
        assert r.json()["error"]["message"] == (
            "stage 'diffusion': request crashed the worker twice; it is not retried"
        )
        wait_for(lambda: stats.worker_deaths - deaths == 2, 5, "the poison's two deaths")
        assert wait_until(lambda: httpx.get(f"{s.url}/health").status_code == 200, 15)
        check_engine(s)


def test_r4_stopped_actor_is_killed_and_its_work_rerun(tmp_path_factory, ray_leaks):
    with live_server(
        tmp_path_factory,
        "null-image",
        stage_kw={"stall_timeout": 1.0},
        engine_kw={**RAY, "max_restarts": 2, "request_timeout": 20},
    ) as s:
        stopped_worker_reruns(s)


def test_r7_sigkill_of_the_server_takes_its_actors_along(tmp_path, cluster):
    """Owner fate-sharing: the actors a server made end when it dies (Ray's bound: the owner's
    death is noticed by the actors' raylet; here within a few seconds)."""
    server = ServeProcess(
        ["null-image", "--replicas", "2", "--executor", "ray", "--ray-address", cluster.address],
        str(tmp_path),
    )
    try:
        server.wait_healthy()
        assert wait_until(lambda: len(actor_processes()) == 2, 10), actor_processes()
        httpx.post(f"{server.url}/v1/images/generations", json={"prompt": "x"}, timeout=10)
        server.proc.kill()
        t0 = time.monotonic()
        assert wait_until(lambda: not actor_processes(), 15), actor_processes()
        took = time.monotonic() - t0
        assert took < 15
        print(f"actors gone {took:.2f}s after the server's SIGKILL")
    finally:
        server.cleanup()
    ray_cluster.nothing_left()
