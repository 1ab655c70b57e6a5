"""R12: slow is not hung, and one bad request is not death. A step slower than the stall
timeout is not killed (its bound follows the replica's measured step time); a hang on the first
step or mid-run is still caught and reported as a stall; a poison request pays for its own
restarts; the restart budget refills after a stable run (real server, real workers)."""

from __future__ import annotations

import os
import signal
import time

import httpx

from tests.api.conftest import live_server
from tests.conftest import wait_for
from tests.reliability.leaks import Baseline, check_engine
from vllm_omni_like.engine import stage_pool


def _post(server, prompt: str, steps: int, timeout: float = 30) -> httpx.Response:
    return httpx.post(
        f"{server.url}/v1/images/generations",
        json={"prompt": prompt, "model": "null-image", "num_inference_steps": steps},
        timeout=timeout,
    )


def test_r12_steps_slower_than_the_stall_timeout_are_not_killed(tmp_path_factory):
    base = Baseline()
    with live_server(
        tmp_path_factory,
        "null-image",
        stage_kw={"stall_timeout": 1.0, "cold_step_timeout": 5.0},
        engine_kw={"request_timeout": 30.0, "max_restarts": 2},
    ) as server:
        t0 = time.monotonic()
        slow = _post(server, "x @delay=1.6", 3)  # every step 1.6 s, over the 1 s stall timeout
        assert slow.status_code == 200, slow.text
        assert 4.8 <= time.monotonic() - t0 < 10
        again = _post(server, "y @delay=1.6", 3)  # a warm shape: 10 x its measured step
        assert again.status_code == 200, again.text
        assert server.engine.stats.worker_deaths == 0
        clock = server.engine.orchestrator.pools["null-image"][0].replicas[0].clock
        assert 1.4 < clock.expected_step_s() < 2.5
        check_engine(server)
    base.check(fd_slack=10)


def test_r12_a_hang_on_the_first_step_is_caught_as_a_stall_and_charged_to_the_request(
    tmp_path_factory,
):
    base = Baseline()
    faults = "stage=diffusion,point=execute,kind=hang,match=@hang"
    with live_server(
        tmp_path_factory,
        "null-image",
        faults=faults,
        stage_kw={"stall_timeout": 1.0, "cold_step_timeout": 1.5},
        engine_kw={"request_timeout": 30.0, "max_restarts": 1},
    ) as server:
        t0 = time.monotonic()
        r = _post(server, "x @hang", 4)
        assert r.status_code == 500, r.text
        message = r.json()["error"]["message"]
        assert message.startswith(
            "stage 'diffusion': request stalled its worker twice (no progress for "
        ), message
        assert message.endswith("s: cold start: no step measured yet)); it is not retried")
        assert time.monotonic() - t0 < 1.5 * 2 + 3  # two first-step bounds, two restarts
        wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 200, 10, "healthy again")
        replica = server.engine.orchestrator.pools["null-image"][0].replicas[0]
        # two deaths with a budget of one restart: both were the request's, not the replica's
        assert replica.restarts == 0
        assert _post(server, "fine", 2).status_code == 200  # the engine lives on
        assert server.engine.stats.worker_deaths == 2
        check_engine(server)
    base.check(fd_slack=10)


def test_r12_the_restart_budget_refills_after_a_stable_run(tmp_path_factory, monkeypatch):
    monkeypatch.setattr(stage_pool, "STABLE_RUN_S", 1.0)
    base = Baseline()
    with live_server(
        tmp_path_factory, "null-image", engine_kw={"max_restarts": 1, "request_timeout": 10.0}
    ) as server:
        pool = server.engine.orchestrator.pools["null-image"][0]
        stats = server.engine.stats
        for kill in range(3):  # three deaths with a budget of one restart
            os.kill(pool.replicas[0].executor.pids[0], signal.SIGKILL)
            wait_for(
                lambda k=kill: stats.restarts == k + 1 and pool.live_count == 1,
                10,
                f"the restart after kill {kill + 1}",
            )
            time.sleep(1.2)  # a stable run: longer than STABLE_RUN_S (1 s here)
        assert httpx.get(f"{server.url}/health").status_code == 200
        assert _post(server, "fine", 2).status_code == 200
        check_engine(server)
    base.check(fd_slack=10)
