"""A step's stall bound: the compile timeout only while the worker says it compiles, a cold-start
allowance before anything was measured, the measured speed after; and an out-of-memory error
caused by the batch being decoded beside is retried once it is freed (real worker processes)."""

from __future__ import annotations

import asyncio
import re
import time

from tests.conftest import wait_for
from tests.engine import stage_doubles
from tests.engine.helpers import engine, final, req
from vllm_omni_like.engine.stall import StepClock

DOUBLES = "tests.engine.stage_doubles"
HANG = "stage=diffusion,point=step,kind=hang,match=@hang"


def _image(rid: str, prompt: str = "a cat", steps: int = 2) -> object:
    return req(rid, prompt, pipeline="null-image", steps=steps, delay=0.05)


def test_a_step_that_compiles_gets_the_compile_timeout_and_a_hang_after_it_does_not():
    kw = {"compile": True, "stall_timeout": 0.5, "cold_step_timeout": 1.0, "compile_timeout": 20}
    with engine(
        "null-image", HANG, stage_kw=kw, stage_kind=f"{DOUBLES}:CompilingStage", max_restarts=2
    ) as e:
        t0 = time.monotonic()
        out = asyncio.run(final(e, _image("first")))
        # the compile (1.5 s) is three times the stall timeout and over the cold allowance
        assert out.ok, out.error
        assert time.monotonic() - t0 >= stage_doubles.COMPILE_S
        assert e.stats.worker_deaths == 0
        assert e.stats.compiles == 1  # one batch size, one compilation (counted before its end)
        assert asyncio.run(final(e, _image("again"))).ok
        assert e.stats.compiles == 1  # the same size again: nothing recompiled
        t0 = time.monotonic()
        bad = asyncio.run(final(e, _image("bad", "x @hang")))
        took = time.monotonic() - t0
        # killed twice at the measured bound, not the compile timeout: the restarted worker
        # compiled again (allowed), then hung
        assert bad.error.message.startswith(
            "stage 'diffusion': request stalled its worker twice (no progress for 0."
        ), bad.error.message
        # the stall timeout (0.5 s) or 10 x a measured step of 0.05 s (more on a loaded host):
        # never the compile timeout's 20 s
        bound = re.search(r"s \(bound ([0-9.]+)s: ", bad.error.message)
        assert bound and 0.5 <= float(bound.group(1)) < 1.0, bad.error.message
        assert "compiling" not in bad.error.message
        assert took < 2 * (stage_doubles.COMPILE_S + 0.5) + 10  # two restarts import torch
        wait_for(lambda: e.stats.worker_deaths == 2, 5, "two stalls counted as deaths")
        pool = e.orchestrator.pools["null-image"][0]
        wait_for(lambda: pool.state == "ready", 30, "the replica restarted")
        assert asyncio.run(final(e, _image("after"))).ok


def test_without_compile_reports_the_same_step_is_a_cold_start_stall():
    """The allowance comes from the worker's report, not from the step being a first one: a
    stage that compiles without `compile` set (no reports) is held to the cold bound."""
    kw = {"stall_timeout": 0.5, "cold_step_timeout": 1.0, "compile_timeout": 20}
    with engine(
        "null-image", stage_kw=kw, stage_kind=f"{DOUBLES}:CompilingStage", max_restarts=2
    ) as e:
        t0 = time.monotonic()
        out = asyncio.run(final(e, _image("first")))
        assert out.error.message.startswith(
            "stage 'diffusion': request stalled its worker twice (no progress for 1."
        ), out.error.message
        assert out.error.message.endswith(
            "s (bound 1.0s: cold start: no step measured yet)); it is not retried"
        )
        assert time.monotonic() - t0 < 2 * stage_doubles.COMPILE_S + 10


def test_out_of_memory_beside_a_decode_is_retried_once_it_is_freed(capfd):
    """Each batch holds memory until its decode ends, so the next batch, begun beside that
    decode, runs out of memory: it waits for the decode, runs again and succeeds, uncharged."""
    kw = {"max_batch_size": 1, "options": {"decode_delay": 0.0}}
    with engine("null-image", stage_kw=kw, stage_kind=f"{DOUBLES}:DecodeHoldsMemoryStage") as e:

        async def run():
            return await asyncio.gather(*(final(e, _image(f"r{i}", f"p{i}")) for i in range(3)))

        outs = asyncio.run(run())
        assert all(o.ok for o in outs), [o.error for o in outs]
        snap = e.stats.snapshot()
        assert snap["final"]["success"] == 3 and snap["final"]["error"] == 0
        assert e.stats.worker_deaths == 0
    err = capfd.readouterr().err
    # batches 2 and 3 each began beside the decode of the one before
    assert err.count("out of memory while the batch before decoded") == 2, err


def test_out_of_memory_with_nothing_beside_is_the_batchs_own():
    kw = {"max_batch_size": 1, "decode_overlap": False}
    faults = "stage=diffusion,point=execute,kind=oom,match=@oom"
    with engine("null-image", faults, stage_kw=kw) as e:
        out = asyncio.run(final(e, _image("o", "x @oom")))
        assert out.error.code == "generation_failed"
        assert "out of memory while running this request" in out.error.message


def test_the_compile_allowance_lasts_while_any_rank_compiles():
    """A CFG-parallel rank 0 waits on rank 1's compile too: the allowance ends with the last."""
    clock = StepClock(stall_timeout=1.0, compile_timeout=30.0, cold_timeout=2.0)
    assert clock.bound() == (2.0, "cold start: no step measured yet")
    clock.speed.sample(0.05, 1.0)  # a measured step of 0.05 s per unit
    clock.begin(1.0, now=0.0)
    clock.compile_state(0, True, now=1.0)
    clock.compile_state(1, True, now=1.5)
    clock.compile_state(0, False, now=5.0)  # rank 1 still compiles
    assert clock.bound() == (30.0, "compiling")
    clock.compile_state(1, False, now=9.0)
    assert clock.bound() == (1.0, "stall timeout") and clock.last_step == 9.0
    clock.step(now=9.5)  # the step that compiled is no sample of the speed
    assert clock.speed.rate == 0.05
