"""The engine snapshot: immutable, replaced (never changed) by the orchestrator thread, and all
that admission, /health and /metrics read of the pools."""

from __future__ import annotations

import asyncio
import dataclasses

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
