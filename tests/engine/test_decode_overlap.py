"""A replica takes its next batch while the last one decodes; aborts, stalls and deaths still
cover the batch being decoded (null stages with a `decode_delay`: no torch)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.conftest import wait_for, wait_until
from tests.engine.helpers import engine, final, req

STEPS, STEP_S, DECODE_S = 3, 0.2, 0.4


def _image(rid: str, prompt: str = "a cat") -> object:
    return req(rid, prompt, pipeline="null-image", steps=STEPS, delay=STEP_S)


def _finishing(replica) -> list:
    """The batches it is finishing (denoised, not done)."""
    return [f for f in replica.inflight.values() if f.denoised is not None]


def _stage_kw(overlap: bool, **kw) -> dict:
    options = {"decode_delay": DECODE_S}
    return {"max_batch_size": 1, "decode_overlap": overlap, "options": options, **kw}


@pytest.mark.parametrize("overlap", [True, False])
def test_decode_runs_beside_the_next_batch(overlap):
    """Three batches of 0.6 s steps + 0.4 s decode: 2.2 s overlapped, 3.0 s one after another."""
    with engine("null-image", stage_kw=_stage_kw(overlap)) as e:

        async def run():
            t0 = time.monotonic()
            outs = await asyncio.gather(*(final(e, _image(f"o{i}")) for i in range(3)))
            return outs, time.monotonic() - t0

        outs, took = asyncio.run(run())
        assert all(o.ok and o.output.images for o in outs)
        # BatchDone is counted after the last result went out: wait for it, not read at once
        wait_for(lambda: e.stats.snapshot()["batch_sizes"] == {1: 3}, 5, "3 batches of 1")
        if overlap:
            assert 3 * STEPS * STEP_S + DECODE_S <= took < 3 * (STEPS * STEP_S + DECODE_S) - 0.3
        else:
            assert took >= 3 * (STEPS * STEP_S + DECODE_S)


def test_an_abort_reaches_a_request_being_decoded():
    with engine("null-image", stage_kw=_stage_kw(True, options={"decode_delay": 1.5})) as e:
        replica = e.orchestrator.pools["null-image"][0].replicas[0]

        async def run():
            task = asyncio.create_task(final(e, req("d", pipeline="null-image", steps=1)))
            assert await asyncio.to_thread(wait_until, lambda: _finishing(replica), 5)
            t0 = time.monotonic()
            e.abort("d")
            out = await task
            return out, time.monotonic() - t0

        out, took = asyncio.run(run())
        assert out.error.code == "aborted" and took < 0.2
        assert wait_until(lambda: not _finishing(replica), 3)  # its BatchDone still came
        after = asyncio.run(final(e, req("next", pipeline="null-image", steps=1)))
        assert after.ok


@pytest.mark.parametrize("kind", ["hang", "exit"])
def test_a_decode_that_hangs_or_kills_the_worker_fails_only_its_request(kind):
    """The culprit's decode stalls (killed after stall_timeout) or exits while the next batch is
    denoising: both batches are re-run apart; the culprit fails the second time, the other
    request succeeds."""
    faults = f"stage=diffusion,point=output,kind={kind},match=@bad"
    kw = _stage_kw(True, stall_timeout=0.8, options={"decode_delay": 0.1})
    with engine("null-image", faults, stage_kw=kw, max_restarts=3) as e:

        async def run():
            t0 = time.monotonic()
            bad = asyncio.create_task(final(e, req("bad", "x @bad", pipeline="null-image")))
            await asyncio.sleep(0.05)
            good = req("good", pipeline="null-image", steps=4, delay=0.1)
            outs = await asyncio.wait_for(asyncio.gather(bad, final(e, good)), 30)
            return outs, time.monotonic() - t0

        (bad, good), took = asyncio.run(run())
        if kind == "exit":
            assert bad.error.message == (
                "stage 'diffusion': request crashed the worker twice; it is not retried"
            )
        else:  # a kill for a stall is reported as a stall
            assert bad.error.message.startswith(
                "stage 'diffusion': request stalled its worker twice (no progress for 0."
            )
            assert bad.error.message.endswith("s (bound 0.8s: decode)); it is not retried")
        assert good.ok and good.output.images
        wait_for(lambda: e.stats.worker_deaths == 2, 5, "two worker deaths counted")
        assert took < 15


def test_a_fragment_waits_for_the_clients_of_the_batch_being_decoded():
    """A request that came in during batch A does not run alone when A leaves the critical
    path: it waits for A's clients, who return after A's decode, and runs with them."""
    kw = {
        "max_batch_size": 4,
        "batch_policy": "refill",
        "batch_wait": 0.5,
        "options": {"decode_delay": 0.3},
    }
    with engine("null-image", stage_kw=kw) as e:

        def image(rid):
            return req(rid, pipeline="null-image", steps=2, delay=0.1)

        async def client(rid):  # a closed-loop client: one request, then the next
            first = await final(e, image(rid))
            return first, await final(e, image(rid + "-again"))

        async def run():
            clients = [asyncio.create_task(client(f"a{i}")) for i in range(3)]
            await asyncio.sleep(0.05)
            extra = await final(e, image("x"))  # queued behind the 3; A is denoised at 0.2 s
            return extra, await asyncio.gather(*clients)

        extra, outs = asyncio.run(run())
        assert extra.ok and all(a.ok and b.ok for a, b in outs)
        assert wait_until(lambda: sum(e.stats.snapshot()["batch_sizes"].values()) == 2, 5)
        wait_for(  # not 3, then 1, then 3
            lambda: e.stats.snapshot()["batch_sizes"] == {3: 1, 4: 1}, 5, "batches {3, 4}"
        )
