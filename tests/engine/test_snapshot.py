"""The engine snapshot: immutable, replaced (never changed) by the orchestrator thread, and all
that admission, /health and /metrics read of the pools."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from tests.conftest import wait_for
from tests.engine.helpers import engine, final, kill_worker, req
from vllm_omni_like.errors import UnavailableError


def test_a_snapshot_is_immutable_and_replaced_as_the_engine_changes():
    with engine("null-image", max_restarts=1) as e:
        orch = e.orchestrator
        before = orch.snapshot
        assert [s.state for s in before.stages] == ["ready"] and before.dead is None
        with pytest.raises(dataclasses.FrozenInstanceError):
            before.stages[0].state = "dead"
        kill_worker(e, "null-image", 0)
        wait_for(lambda: orch.snapshot.stages[0].state == "restarting", 5, "restarting seen")
        with pytest.raises(UnavailableError, match="a restart is under way"):  # admission reads it
            orch.submit(req("r1", pipeline="null-image"), lambda event: None)
        assert e.health()[0]["state"] == "restarting"
        assert before.stages[0].state == "ready"  # the old one is untouched
        wait_for(lambda: orch.snapshot.stages[0].state == "ready", 10, "ready again")
        assert orch.snapshot.stages[0].restarts == 1


def test_running_counts_a_batch_still_decoding_beside_the_next():
    kw = {"max_batch_size": 1, "decode_overlap": True, "options": {"decode_delay": 1.0}}
    with engine("null-image", stage_kw=kw) as e:
        orch = e.orchestrator

        async def run():
            jobs = [
                asyncio.ensure_future(
                    final(e, req(f"d{i}", pipeline="null-image", steps=4, delay=0.25))
                )
                for i in range(2)
            ]
            # d0 decodes (1 s) while d1 denoises: both are running on the one replica
            seen = await asyncio.to_thread(
                wait_for, lambda: orch.snapshot.stages[0].running == 2, 5, "two running"
            )
            return seen, await asyncio.gather(*jobs)

        seen, outs = asyncio.run(run())
        assert seen and all(o.ok for o in outs)
        wait_for(lambda: orch.snapshot.stages[0].running == 0, 5, "none running after")


def test_each_replica_says_what_its_start_and_its_restart_took():
    """A worker reports its start (seconds; a compiled one its compile cache and CUDA graphs);
    a replica restarted after its worker died says the seconds from the death to ready, in
    /health and /metrics (api/metrics.py)."""
    from vllm_omni_like.api.metrics import Metrics

    with engine("null-image", max_restarts=1) as e:
        orch = e.orchestrator
        (view,) = orch.snapshot.stages[0].replicas
        assert view.start is not None and view.start.seconds > 0 and view.restart_seconds is None
        health = view.health()
        assert health["start_seconds"] == round(view.start.seconds, 3)
        assert "restart_seconds" not in health and "compile_cache" not in health  # not compiled
        killed_at = time.monotonic()
        kill_worker(e, "null-image", 0)
        wait_for(lambda: orch.snapshot.stages[0].replicas[0].restart_seconds, 10, "a restart")
        took = time.monotonic() - killed_at
        (view,) = orch.snapshot.stages[0].replicas
        assert 0 < view.restart_seconds <= took and view.start.seconds < view.restart_seconds
        assert e.health()[0]["replicas"][0]["restart_seconds"] == round(view.restart_seconds, 3)
        metrics = Metrics(e).render().decode()
        labels = '{device="auto",pipeline="null-image",replica="0",stage="diffusion"}'
        assert f"vllm_omni_like_replica_restart_seconds{labels} {view.restart_seconds}" in metrics
        assert f"vllm_omni_like_replica_start_seconds{labels} {view.start.seconds}" in metrics


def test_a_compiled_replica_s_health_names_its_compile_cache_and_graphs():
    from vllm_omni_like.engine.snapshot import ReplicaView
    from vllm_omni_like.wire import StartReport

    start = StartReport(12.3456, "/s/compile-cache", 7, 0, ("2x4x64x64", "4x4x64x64"), 2**20, 5)
    body = ReplicaView(0, "cuda:0", "ready", 0, (11,), start, 4.5).health()
    assert body["start_seconds"] == 12.346 and body["restart_seconds"] == 4.5
    assert body["compile_cache"] == {
        "dir": "/s/compile-cache",
        "hits": 7,
        "misses": 0,
        "precompiled": 5,
        "traced": 0,
    }
    assert body["cuda_graphs"] == ["2x4x64x64", "4x4x64x64"] and body["cuda_graph_bytes"] == 2**20


def test_a_replica_says_its_idle_expert_offload_from_its_start_and_each_batch():
    """A worker's `Stage.offload` report reaches /health (the stage's mode, each replica's
    resident expert, swaps, last swap seconds, bytes) and /metrics: at its start, then after
    each batch."""
    from vllm_omni_like.api.metrics import Metrics

    kind = "tests.engine.stage_doubles:OffloadingStage"
    with engine("null-image", stage_kind=kind) as e:
        (stage,) = e.health()
        assert "offload" not in stage  # (a null stage's mode is not said: --offload none)
        view = dataclasses.replace(e.orchestrator.snapshot.stages[0], offload="idle-expert")
        assert view.health()["offload"] == "idle-expert"
        assert stage["replicas"][0]["offload"] == {
            "resident": "transformer",
            "swaps": 0,
            "last_swap_seconds": None,
            "device_bytes": 1000,
            "host_bytes": 2000,
        }
        assert asyncio.run(final(e, req("r1", pipeline="null-image"))).ok
        orch = e.orchestrator
        wait_for(lambda: orch.snapshot.stages[0].replicas[0].offload.swaps == 1, 5, "a swap")
        said = e.health()[0]["replicas"][0]["offload"]
        assert (said["resident"], said["swaps"], said["last_swap_seconds"]) == (
            "transformer_2",
            1,
            0.25,
        )
        metrics = Metrics(e).render().decode()
        labels = '{device="auto",pipeline="null-image",replica="0",stage="diffusion"}'
        assert f"vllm_omni_like_replica_expert_swaps_total{labels} 1.0" in metrics
        assert "# TYPE vllm_omni_like_replica_expert_swaps_total counter" in metrics
        assert f"vllm_omni_like_replica_expert_swap_seconds{labels} 0.25" in metrics
        assert f"vllm_omni_like_replica_expert_device_bytes{labels} 1000.0" in metrics
