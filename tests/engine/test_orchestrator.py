"""The orchestrator on null pipelines: chaining, batching, faults, aborts, deadlines."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import psutil
import pytest

from tests.conftest import wait_for, wait_until
from tests.engine.helpers import assert_clean, collect, engine, final, gather, req, steps_of
from vllm_omni_like.config import EngineConfig
from vllm_omni_like.engine import AsyncOmni
from vllm_omni_like.errors import (
    ConflictError,
    EngineDeadError,
    ErrorKind,
    NotFoundError,
    QueueFullError,
)
from vllm_omni_like.executor.multiproc import SHUTDOWN_GRACE_S
from vllm_omni_like.outputs import OmniRequestOutput, RequestProgress
from vllm_omni_like.pipelines.catalog import resolve

FAULTS = (
    "stage=llm,point=execute,kind=raise,match=@llmfail;"
    "stage=diffusion,point=step,kind=invalid,match=@invalid;"
    "stage=diffusion,point=output,kind=oom,match=@oom"
)


@pytest.fixture(scope="module")
def eng():
    with engine("null-omni", FAULTS, stage_kw={"max_batch_size": 8}) as e:
        yield e


def test_two_stages_chain_and_return_the_revised_prompt(eng):
    events, out = asyncio.run(collect(eng, req("c1", "a red circle", steps=3)))
    assert out.ok and out.error is None
    assert out.revised_prompt.startswith("a red circle (rewritten #")
    assert set(out.stage_outputs) == {"llm", "diffusion"}
    assert out.output.images[0].pixels.shape == (64, 64, 3)
    stages = [(e.stage, e.step, e.total) for e in events if isinstance(e, RequestProgress)]
    assert stages == [
        ("llm", 1, 3),
        ("llm", 2, 3),
        ("llm", 3, 3),
        ("diffusion", 1, 3),
        ("diffusion", 2, 3),
        ("diffusion", 3, 3),
    ]


def test_concurrent_requests_are_batched_and_equal_single_runs(eng):
    before = dict(eng.stats.batch_sizes)
    reqs = [req(f"b{i}", f"prompt {i}", seed=i, steps=3, delay=0.01) for i in range(12)]
    outs = asyncio.run(gather(eng, reqs))
    assert all(o.ok for o in outs)

    def grown():  # batches are counted at their BatchDone, after their results went out
        now = eng.stats.snapshot()["batch_sizes"]
        return {k: v - before.get(k, 0) for k, v in now.items() if v > before.get(k, 0)}

    # 12 requests through both stages of null-omni: 24 rows (an earlier test's batch may end
    # meanwhile and count too)
    wait_for(lambda: sum(k * v for k, v in grown().items()) >= 24, 5, "24 rows batched")
    assert max(grown()) > 1
    for i in (0, 7):
        alone = asyncio.run(final(eng, req(f"s{i}", f"prompt {i}", seed=i, steps=3)))
        assert np.array_equal(alone.output.images[0].pixels, outs[i].output.images[0].pixels)
        assert alone.revised_prompt == outs[i].revised_prompt


def test_faults_in_each_stage_fail_only_their_request(eng):
    reqs = [
        req("ok1"),
        req("f1", "x @llmfail"),
        req("f2", "y @invalid"),
        req("f3", "z @oom"),
        req("ok2"),
    ]
    outs = {o.request_id: o for o in asyncio.run(gather(eng, reqs))}
    assert outs["ok1"].ok and outs["ok2"].ok
    e1, e2, e3 = outs["f1"].error, outs["f2"].error, outs["f3"].error
    assert (e1.status, e1.stage) == (500, "llm")
    assert e1.message.startswith(
        "stage 'llm': InjectedFault: injected raise fault at execute for request f1 (t="
    )
    assert (e2.status, e2.stage, e2.kind) == (400, "diffusion", ErrorKind.INVALID)
    assert (e3.status, e3.stage) == (500, "diffusion") and "out of memory" in e3.message
    assert not eng.errored
    assert [h["state"] for h in eng.health()] == ["ready", "ready"]


def test_unknown_pipeline_and_admission(eng):
    async def run():
        with pytest.raises(NotFoundError, match="model 'nope' is not served here"):
            await final(eng, req("u", pipeline="nope"))

    asyncio.run(run())


def test_abort_while_queued_in_llm_and_mid_denoising(eng):
    async def run():
        slow = [req(f"q{i}", steps=40, delay=0.02) for i in range(3)]
        # occupy both stages, then abort: one in the LLM stage, one mid-denoising, one queued
        tasks = [asyncio.create_task(collect(eng, r)) for r in slow]
        await asyncio.sleep(0.4)
        for r in slow:
            eng.abort(r.request_id)
        return await asyncio.gather(*tasks)

    t0 = time.monotonic()
    results = asyncio.run(run())
    assert time.monotonic() - t0 < 5
    for _, out in results:
        assert out.error is not None and out.error.code == "aborted"
    time.sleep(1.2)  # any step a worker still ran for them would show now
    for i in range(3):
        steps = steps_of(eng, f"q{i}", "llm") + steps_of(eng, f"q{i}", "diffusion")
        assert all(n < 40 for n in steps)
    wait_for(lambda: eng.stats.final["aborted"] >= 3, 5, "3 aborts counted")


def test_closing_the_stream_aborts_the_request(eng):
    async def run():
        gen = eng.generate(req("gone", steps=200, delay=0.01))
        first = await gen.__anext__()
        assert isinstance(first, RequestProgress)
        await gen.aclose()  # the client went away

    asyncio.run(run())
    wait_for(lambda: "gone" not in eng.orchestrator.requests, 5, "the request state dropped")
    assert all(n < 200 for n in steps_of(eng, "gone", "llm"))


def test_an_abort_before_registration_is_remembered(eng):
    eng.abort("early")
    out = asyncio.run(final(eng, req("early")))
    assert out.error.code == "aborted"
    assert eng.orchestrator.early_aborts == {}


def test_an_abort_after_the_end_is_not_remembered(eng):
    """A client that leaves while its final output is on the way aborts an ended request."""
    out = asyncio.run(final(eng, req("done")))
    assert out.ok
    eng.abort("done")
    assert wait_until(lambda: eng.orchestrator.inbox.empty(), 5)
    time.sleep(0.1)  # the orchestrator thread has handled it
    assert "done" not in eng.orchestrator.early_aborts


def test_deadline_ends_the_request_with_timeout(eng):
    t0 = time.monotonic()
    out = asyncio.run(final(eng, req("slow", steps=100, delay=0.02, timeout=0.3)))
    assert time.monotonic() - t0 < 1.5
    assert out.error.kind is ErrorKind.TIMEOUT and out.error.status == 504
    assert out.error.message.startswith("stage 'llm': the request's deadline of 0.3s passed")


def test_counters_balance(eng):
    assert_clean_soon(eng)


def assert_clean_soon(eng):
    wait_for(lambda: not eng.orchestrator.requests, 5, "no request state left")
    assert_clean(eng)


def test_admission_refuses_when_the_pipeline_is_full():
    with engine("null-image", max_queue_size=2) as e:

        async def run():
            tasks = [
                asyncio.create_task(
                    final(e, req(f"a{i}", pipeline="null-image", steps=20, delay=0.02))
                )
                for i in range(2)
            ]
            await asyncio.sleep(0.05)
            with pytest.raises(QueueFullError) as info:
                await final(e, req("third", pipeline="null-image"))
            assert info.value.retry_after == 1.0 and info.value.status == 429
            return await asyncio.gather(*tasks)

        outs = asyncio.run(run())
        assert all(o.ok for o in outs)
        assert e.stats.requests_total == 2


def test_orchestrator_thread_death_fails_every_waiting_request(monkeypatch):
    with engine("null-image") as e:

        async def run():
            task = asyncio.create_task(
                final(e, req("w", pipeline="null-image", steps=50, delay=0.02))
            )
            await asyncio.sleep(0.2)

            def boom(msg):
                raise RuntimeError("bug in the loop")

            monkeypatch.setattr(e.orchestrator, "_handle", boom)
            e.abort("anything")  # the next message crashes the thread
            return await asyncio.wait_for(task, 5)

        out = asyncio.run(run())
        assert out.error.kind is ErrorKind.DEAD
        assert "orchestrator thread died: RuntimeError: bug in the loop" in out.error.message
        assert e.errored
        with pytest.raises(EngineDeadError):
            e.check_health()


def test_back_pressure_holds_work_in_the_earlier_stage():
    # the image stage's 0.1 s decode makes it the slower one (the LLM stand-in has no decode)
    kw = {"max_batch_size": 1, "options": {"decode_delay": 0.1}}
    with engine("null-omni", stage_kw=kw) as e:
        downstream = e.orchestrator.pools["null-omni"][1]
        peak = []

        async def run():
            reqs = [req(f"bp{i}", "x @delay=0.01", steps=5) for i in range(12)]
            tasks = [asyncio.create_task(final(e, r)) for r in reqs]
            while not all(t.done() for t in tasks):
                peak.append(len(downstream.waiting))
                await asyncio.sleep(0.005)
            return [t.result() for t in tasks]

        outs = asyncio.run(run())
        assert all(o.ok for o in outs)  # held back, never refused
        assert max(peak) <= downstream.capacity + 1  # one LLM batch may land after the check
        assert max(peak) >= 1


def test_offline_omni_is_the_same_path():
    from vllm_omni_like.config import EngineConfig
    from vllm_omni_like.engine import Omni
    from vllm_omni_like.pipelines.catalog import resolve

    with Omni(EngineConfig(pipelines=tuple(resolve("null-image")))) as omni:
        outs = omni.generate(
            [req(f"o{i}", f"p{i}", pipeline="null-image", seed=i) for i in range(4)]
        )
        assert [o.request_id for o in outs] == ["o0", "o1", "o2", "o3"]
        assert all(o.ok and o.output.images for o in outs)
        future = omni.submit(req("bad", "x", pipeline="null-image", width=99999))
        assert future.result(10).error.status == 400


def test_stages_shut_down_side_by_side_not_one_after_the_other():
    """Two pipelines, each with a batch its worker will not end early (no abort reaches it):
    each executor gives its worker SHUTDOWN_GRACE_S before killing it, and the engine's
    shutdown takes about one grace period, not one per stage."""
    eng = AsyncOmni(EngineConfig(pipelines=(*resolve("null-image"), *resolve("null-video"))))
    eng.start()
    names = ("null-image", "null-video")

    async def main() -> float:
        tasks = [  # 100 steps x 0.1 s each: 10 s of work
            asyncio.create_task(final(eng, req(f"long-{n}", pipeline=n, steps=100, delay=0.1)))
            for n in names
        ]
        for n in names:
            replica = eng.orchestrator.pools[n][0].replicas[0]
            assert await asyncio.to_thread(wait_until, lambda r=replica: r.inflight, 10)
        pids = [p for n in names for p in eng.orchestrator.pools[n][0].replicas[0].executor.pids]
        started = time.monotonic()
        await asyncio.to_thread(eng.shutdown)
        took = time.monotonic() - started
        assert len(pids) == 2 and not any(psutil.pid_exists(p) for p in pids)  # both stopped
        outs = await asyncio.gather(*tasks)
        assert all(o.error is not None for o in outs)  # ended by the shutdown, none left waiting
        return took

    took = asyncio.run(main())
    assert took < SHUTDOWN_GRACE_S + 2.0, f"shutdown took {took:.1f}s"


def test_a_duplicate_live_request_id_is_refused_and_the_first_request_is_untouched():
    with engine("null-image") as e:

        async def run():
            first = e.open(req("same", pipeline="null-image", steps=4, delay=0.05))
            with pytest.raises(ConflictError) as refused:
                e.open(req("same", pipeline="null-image"))
            while not isinstance(out := await first.next(), OmniRequestOutput):
                pass
            return refused.value, out, await final(e, req("same", pipeline="null-image"))

        refused, out, again = asyncio.run(run())
        assert refused.status == 409 and refused.code == "duplicate_request_id"
        assert refused.message == "request id 'same' is already in the engine; ids must be unique"
        assert out.ok  # the first one ran to its end, its state whole
        assert again.ok  # once it ended, the id is free again
        snap = e.stats.snapshot()
        assert snap["requests_total"] == 2 and snap["final"]["success"] == 2
        assert e.orchestrator.admission.held("null-image")[0] == 0  # its slots given back
