"""Replica deaths, re-routing, restarts, the poison rule and stall detection (null stages)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.conftest import wait_for, wait_until
from tests.engine.helpers import engine, final, kill_worker, req
from vllm_omni_like.errors import EngineDeadError, ErrorKind


def _states(e):
    return {h["name"]: h["state"] for h in e.health()}


def test_death_reroutes_to_the_live_replica_without_rerunning_the_llm():
    with engine("null-omni", stage_kw={"replicas": 2}, max_restarts=3) as e:

        async def run():
            reqs = [req(f"r{i}", f"p{i}", seed=i, steps=30, delay=0.02) for i in range(6)]
            tasks = [asyncio.create_task(final(e, r)) for r in reqs]
            pool = e.orchestrator.pools["null-omni"][1]
            assert await asyncio.to_thread(
                wait_until, lambda: pool.replicas[0].critical is not None, 5
            )
            kill_worker(e, "null-omni", 1, replica=0)
            await asyncio.sleep(0.3)
            assert _states(e)["diffusion"] == "ready"  # the other replica is live
            return await asyncio.gather(*tasks)

        outs = asyncio.run(run())
        assert all(o.ok for o in outs), [o.error for o in outs]
        snap = wait_for(
            lambda: (s := e.stats.snapshot())["worker_deaths"] == 1 and s, 5, "the death counted"
        )
        assert snap["stage_requests"]["llm"] == 6  # earlier stage outputs reused, not recomputed
        assert snap["stage_requests"]["diffusion"] > 6  # the lost ones ran again
        assert snap["worker_deaths"] == 1
        assert wait_until(
            lambda: _states(e)["diffusion"] == "ready" and e.health()[1]["replicas_live"] == 2, 10
        )


def test_poison_request_kills_at_most_two_workers_then_fails():
    faults = "stage=diffusion,point=step,kind=exit,match=@poison"
    with engine("null-image", faults, stage_kw={"replicas": 2}, max_restarts=3) as e:

        async def run():
            poison = asyncio.create_task(final(e, req("p", "x @poison", pipeline="null-image")))
            others = [
                asyncio.create_task(
                    final(e, req(f"o{i}", pipeline="null-image", steps=5, delay=0.01))
                )
                for i in range(4)
            ]
            return await asyncio.wait_for(poison, 20), await asyncio.gather(*others)

        bad, good = asyncio.run(run())
        assert bad.error.kind is ErrorKind.GENERATE and bad.error.status == 500
        assert bad.error.message == (
            "stage 'diffusion': request crashed the worker twice; it is not retried"
        )
        assert all(o.ok for o in good)
        wait_for(lambda: e.stats.worker_deaths == 2, 5, "two worker deaths counted")
        assert not e.errored


def test_restart_after_death_reruns_in_flight_requests():
    with engine("null-image", max_restarts=1) as e:

        async def run():
            tasks = [
                asyncio.create_task(
                    final(e, req(f"r{i}", pipeline="null-image", steps=20, delay=0.02, timeout=30))
                )
                for i in range(4)
            ]
            await asyncio.sleep(0.2)
            kill_worker(e, "null-image", 0)
            t0 = time.monotonic()
            assert await asyncio.to_thread(
                wait_until, lambda: _states(e)["diffusion"] == "restarting", 2
            )
            assert time.monotonic() - t0 < 2
            return await asyncio.gather(*tasks)

        outs = asyncio.run(run())
        assert all(o.ok for o in outs), [o.error for o in outs]
        assert _states(e)["diffusion"] == "ready"
        wait_for(lambda: e.stats.restarts == 1, 5, "one restart counted")


def test_no_restart_left_makes_the_engine_dead():
    with engine("null-image", max_restarts=0) as e:

        async def run():
            tasks = [
                asyncio.create_task(
                    final(e, req(f"r{i}", pipeline="null-image", steps=50, delay=0.02))
                )
                for i in range(16)
            ]
            await asyncio.sleep(0.2)
            kill_worker(e, "null-image", 0)
            t0 = time.monotonic()
            outs = await asyncio.wait_for(asyncio.gather(*tasks), 2)
            return outs, time.monotonic() - t0

        outs, elapsed = asyncio.run(run())
        assert elapsed < 2
        for o in outs:
            assert o.error.kind is ErrorKind.DEAD and o.error.status == 503
            assert (
                "killed by signal SIGKILL; no live replica and no restart left" in o.error.message
            )
        assert _states(e)["diffusion"] == "dead" and e.errored

        async def late():
            t0 = time.monotonic()
            with pytest.raises(EngineDeadError):
                await final(e, req("late", pipeline="null-image"))
            return time.monotonic() - t0

        assert asyncio.run(late()) < 0.1
        wait_for(lambda: e.stats.final["dead"] == 16, 5, "16 requests counted dead")


def test_stalled_worker_is_killed_and_handled_as_a_death():
    faults = "stage=diffusion,point=step,kind=hang,match=@hang"
    kw = {"stall_timeout": 0.5, "cold_step_timeout": 1.0}
    with engine("null-image", faults, stage_kw=kw, max_restarts=2) as e:

        async def run():
            t0 = time.monotonic()
            out = await asyncio.wait_for(final(e, req("h", "x @hang", pipeline="null-image")), 20)
            return out, time.monotonic() - t0

        out, elapsed = asyncio.run(run())
        # stalled once, re-queued, stalled again: the poison rule ends it, as a stall
        assert out.error.message.startswith(
            "stage 'diffusion': request stalled its worker twice (no progress for "
        )
        assert out.error.message.endswith(
            "s: cold start: no step measured yet)); it is not retried"
        )
        wait_for(lambda: e.stats.worker_deaths == 2, 5, "two stalls counted as deaths")
        assert elapsed < 10
        assert wait_until(lambda: _states(e)["diffusion"] == "ready", 10)
        ok = asyncio.run(final(e, req("fine", pipeline="null-image")))
        assert ok.ok


@pytest.mark.parametrize("wait, want", [(0.0, {7: 1, 1: 1}), (0.5, {8: 1})])
def test_after_a_batch_the_replica_waits_briefly_for_its_clients_to_come_back(wait, want):
    """Closed-loop clients return one by one; --batch-wait keeps their next batch whole."""
    with engine(
        "null-image", stage_kw={"max_batch_size": 8, "batch_policy": "refill", "batch_wait": wait}
    ) as e:

        def image(rid):
            return req(rid, pipeline="null-image", steps=4, delay=0.1)

        async def batches(count):  # a batch is counted once its worker says it is done
            done = lambda: sum(e.stats.snapshot()["batch_sizes"].values()) >= count  # noqa: E731
            assert await asyncio.to_thread(wait_until, done, 5)
            return dict(e.stats.snapshot()["batch_sizes"])

        async def run():
            first = asyncio.create_task(final(e, image("r0")))
            await asyncio.sleep(0.05)  # r0 runs alone; the next 8 queue behind it
            await asyncio.gather(first, *(final(e, image(f"r{i}")) for i in range(1, 9)))
            before = await batches(2)
            assert before == {1: 1, 8: 1}
            # the 8 clients come back: 7 at once, the last 50 ms later (window: 0.5 x 0.4 s)
            seven = [asyncio.create_task(final(e, image(f"s{i}"))) for i in range(7)]
            await asyncio.sleep(0.05)
            outs = await asyncio.gather(final(e, image("s7")), *seven)
            assert all(o.ok for o in outs)
            after = await batches(2 + len(want))
            return {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k)}

        t0 = time.monotonic()
        assert asyncio.run(run()) == want
        assert time.monotonic() - t0 < 5


def test_a_stage_that_was_idle_takes_a_request_at_once():
    kw = {"batch_policy": "refill", "batch_wait": 1.0}  # (request-level never holds)
    with engine("null-image", stage_kw=kw) as e:

        async def run():
            await final(e, req("warm", pipeline="null-image", steps=2, delay=0.2))
            await asyncio.sleep(0.5)  # longer than any refill window (1.0 x 0.4 s)
            t0 = time.monotonic()
            out = await final(e, req("solo", pipeline="null-image", steps=1))
            return out, time.monotonic() - t0

        out, took = asyncio.run(run())
        assert out.ok and took < 0.1


def test_a_death_reruns_its_batch_by_halves_and_charges_only_the_convicted_request():
    """A batch of eight of which one kills its worker: the suspects re-run as halves, each
    alone on the replica (8 -> 4 + 4 -> 2 + 2 -> 1 + 1), so the culprit is convicted at its
    fourth death, not after eight runs of one; each death of its chain is refunded (a budget
    of one restart survives four deaths) and the innocents it explains run together again."""
    faults = "stage=diffusion,point=step,kind=exit,match=@poison"
    with engine("null-image", faults, stage_kw={"max_batch_size": 8}, max_restarts=1) as e:
        pool = e.orchestrator.pools["null-image"][0]
        dispatched: list[list[str]] = []  # each batch's request ids, as the pool sends it
        dispatch = pool.dispatch

        def recorded(next_batch_id):
            sent = dispatch(next_batch_id)
            dispatched.extend([s.request_id for s in batch] for batch in sent)
            return sent

        pool.dispatch = recorded

        async def run():
            blocker = asyncio.create_task(  # holds the replica while the eight queue together
                final(e, req("blocker", pipeline="null-image", steps=6, delay=0.05))
            )
            await asyncio.to_thread(wait_for, lambda: pool.replicas[0].running, 5, "the blocker")
            reqs = [req(f"a{i}", f"p{i}", pipeline="null-image", steps=3) for i in range(7)]
            reqs.insert(5, req("culprit", "x @poison", pipeline="null-image", steps=3))
            outs = await asyncio.gather(*(final(e, r) for r in reqs))
            return outs, await blocker

        outs, blocker = asyncio.run(run())
        culprit = outs.pop(5)
        assert blocker.ok and all(o.ok for o in outs), [o.error for o in outs]
        assert culprit.error.message == (
            "stage 'diffusion': request crashed the worker 4 times; it is not retried"
        )
        wait_for(lambda: e.stats.worker_deaths == 4, 5, "four deaths counted")
        assert pool.replicas[0].restarts == 0  # all four were the culprit's: the budget is whole
        wait_for(lambda: pool.live_count == 1, 10, "the replica back after the fourth death")
        assert not e.errored

        # the batches the seven innocents ended in: those dispatched without the culprit
        # (only the culprit kills; a batch's own report can be lost with the worker the next
        # batch kills, so the count is of what the orchestrator dispatched)
        clean = [[r for r in b if r != "blocker"] for b in dispatched if "culprit" not in b]
        clean = [b for b in clean if b]  # (the blocker, in the first death too, re-ran alone)
        assert sorted(r for b in clean for r in b) == sorted(f"a{i}" for i in range(7)), clean
        assert len(clean) <= 4 and sum(len(b) == 1 for b in clean) <= 1, clean


def test_a_culprits_error_goes_out_as_soon_as_bisection_finds_it():
    """A batch of eight whose first request raises at its first step: bisection finds it after
    three short failing runs, and its error goes out then, not after its seven innocent
    neighbours have re-run (about 1.5 s of steps)."""
    faults = "stage=diffusion,point=step,kind=raise,match=@bad"
    with engine("null-image", faults, stage_kw={"max_batch_size": 8}) as e:
        pool = e.orchestrator.pools["null-image"][0]

        async def run():
            blocker = asyncio.create_task(
                final(e, req("blocker", pipeline="null-image", steps=6, delay=0.05))
            )
            await asyncio.to_thread(wait_for, lambda: pool.replicas[0].running, 5, "the blocker")
            reqs = [req("a0", "x @bad", pipeline="null-image", steps=10, delay=0.05)]
            reqs += [
                req(f"a{i}", f"p{i}", pipeline="null-image", steps=10, delay=0.05)
                for i in range(1, 8)
            ]
            done: dict[str, float] = {}

            async def timed(r):
                out = await final(e, r)
                done[r.request_id] = time.monotonic()
                return out

            outs = await asyncio.gather(*(timed(r) for r in reqs))
            await blocker
            return outs, done

        outs, done = asyncio.run(run())
        assert outs[0].error is not None and outs[0].error.status == 500
        assert all(o.ok for o in outs[1:]), [o.error for o in outs[1:]]
        first_peer = min(t for rid, t in done.items() if rid != "a0")
        assert done["a0"] < first_peer - 0.4, (done["a0"], first_peer)
