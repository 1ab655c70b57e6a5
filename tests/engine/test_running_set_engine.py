"""The running-set contract through the engine, real worker processes: a stage that steps
token-like rows (tests/stage_helpers.py `TokenStepStage`, not diffusion) takes a request into
its running set at the next step boundary instead of after the batch; an aborted row and a
row whose step fails leave alone, their peers finish with what they make alone."""

from __future__ import annotations

import asyncio
import time

from tests.engine.helpers import engine, final, kill_worker, req, steps_of
from vllm_omni_like.errors import ErrorKind
from vllm_omni_like.inputs import OmniRequest
from vllm_omni_like.outputs import OmniRequestOutput, RequestProgress
from vllm_omni_like.params import GenerationParams, GuideSpec

TOKENS = "tests.stage_helpers:TokenStepStage"
SLOW = "a long story @delay=0.05"


async def _running(eng, request: OmniRequest, steps: int, started: asyncio.Event):
    """The request's final output; `started` is set once it reported `steps` steps."""
    async for event in eng.generate(request):
        if isinstance(event, RequestProgress) and event.step >= steps:
            started.set()
        if isinstance(event, OmniRequestOutput):
            return event
    raise AssertionError("no final output")


def _text(out: OmniRequestOutput) -> str:
    assert out.error is None, out.error
    return next(iter(out.stage_outputs.values())).text


def test_a_request_joins_the_running_set_and_ends_long_before_the_set_does():
    with engine(stage_kind=TOKENS) as eng:
        alone = _text(asyncio.run(final(eng, req("alone", "short one", steps=3, seed=9))))

        async def run():
            running = asyncio.Event()
            long = asyncio.create_task(_running(eng, req("long", SLOW, steps=40), 3, running))
            await asyncio.wait_for(running.wait(), 30)  # 3 of its 40 steps (2 s) are done
            started = time.monotonic()
            short = await final(eng, req("short", "short one", steps=3, seed=9))
            took = time.monotonic() - started
            assert not long.done(), "the short request waited for the long one's batch"
            return short, took, await long

        short, took, long = asyncio.run(run())
        assert _text(short) == alone  # the same tokens as alone
        assert len(_text(long).split()) == 40
        assert took < 1.5, took  # 3 steps of 0.05 s beside the long one, not its 2 s
        joined = [b for b in eng.batches if b.stage == "llm" and b.size == 1]
        assert len(joined) >= 3  # alone, long, short: each its own group of the set


def test_an_aborted_row_leaves_the_set_and_its_peer_finishes_whole():
    with engine(stage_kind=TOKENS) as eng:

        async def run():
            running = asyncio.Event()
            keep = asyncio.create_task(final(eng, req("keep", SLOW, steps=20)))
            gone = asyncio.create_task(_running(eng, req("gone", SLOW, steps=20), 2, running))
            await asyncio.wait_for(running.wait(), 30)
            gone.cancel()  # the client left: the engine aborts it in its stage
            return await keep

        out = asyncio.run(run())
        assert len(_text(out).split()) == 20
        ran = steps_of(eng, "gone", "llm")
        assert ran and ran[0] < 20  # it left the set early (its batch report says so)


def test_a_row_whose_step_fails_fails_alone_and_its_peers_finish_as_alone():
    with engine(faults="stage=llm,point=step,kind=raise,match=@boom", stage_kind=TOKENS) as eng:
        alone = _text(asyncio.run(final(eng, req("a0", "peer", steps=6, seed=4))))

        async def run():
            return await asyncio.gather(
                final(eng, req("a", "peer", steps=6, seed=4)),
                final(eng, req("bad", "peer @boom", steps=6)),
                final(eng, req("b", "other peer", steps=4)),
            )

        a, bad, b = asyncio.run(run())
        assert bad.error is not None and bad.error.kind is ErrorKind.GENERATE
        assert "injected raise fault at step" in bad.error.message
        assert _text(a) == alone and len(_text(b).split()) == 4


def test_a_rows_deadline_ends_it_alone_in_the_set():
    with engine(stage_kind=TOKENS) as eng:

        async def run():
            return await asyncio.gather(
                final(eng, req("peer", SLOW, steps=12)),
                final(eng, req("late", SLOW, steps=40, timeout=0.3)),  # 2 s of steps
            )

        peer, late = asyncio.run(run())
        assert late.error is not None and late.error.kind is ErrorKind.TIMEOUT
        assert len(_text(peer).split()) == 12


async def _set_of(eng, requests: list[OmniRequest]) -> list[asyncio.Task]:
    """The requests' tasks, each sent once the one before it reported a step: they join one
    replica's running set one after the other."""
    tasks = []
    for request in requests:
        running = asyncio.Event()
        tasks.append(asyncio.create_task(_running(eng, request, 1, running)))
        await asyncio.wait_for(running.wait(), 30)
    return tasks


def test_a_worker_that_dies_mid_set_reruns_its_rows_by_halves_without_spending_more():
    """Four rows in a set when the worker is killed: they re-run as two cohorts of two, one
    after the other on the restarted replica, and end with what they make alone; each spent
    its one retry (`--max-request-retries 1`) once."""
    with engine(stage_kind=TOKENS, max_restarts=1) as eng:
        alone = _text(asyncio.run(final(eng, req("alone", SLOW, steps=12, seed=3))))
        pool = eng.orchestrator.pools["null-omni"][0]

        async def run():
            reqs = [req(f"r{i}", SLOW, steps=12, seed=3) for i in range(4)]
            tasks = await _set_of(eng, reqs)
            states = [eng.orchestrator.requests[r.request_id] for r in reqs]
            before = len(eng.batches)
            kill_worker(eng, "null-omni", 0)
            return await asyncio.gather(*tasks), states, before

        outs, states, before = asyncio.run(run())
        assert [_text(o) for o in outs] == [alone] * 4
        assert eng.stats.worker_deaths == 1 and [s.retries for s in states] == [1] * 4
        reruns = [b for b in eng.batches[before:] if b.stage == "llm"]
        assert sorted(b.size for b in reruns) == [2, 2], reruns  # two cohorts, not 4 runs of 1
        assert {r for b in reruns for r in b.steps_run} == {f"r{i}" for i in range(4)}
        assert pool.replicas[0].restarts == 1  # a crash no conviction explains: the replica's


def test_a_poison_row_in_a_set_is_convicted_by_halves_and_its_peers_pay_nothing():
    """A row that kills its worker joins a set of three: 4 -> 2 + 2 -> 1 + 1, convicted at its
    third death; its peers finish whole though they were present at two deaths each, and the
    replica's budget of one restart is whole again."""
    faults = "stage=llm,point=step,kind=exit,match=@poison"
    with engine(faults=faults, stage_kind=TOKENS, max_restarts=1) as eng:
        pool = eng.orchestrator.pools["null-omni"][0]

        async def run():
            reqs = [req(f"p{i}", SLOW, steps=8) for i in range(3)]
            tasks = await _set_of(eng, reqs)
            tasks.append(asyncio.create_task(final(eng, req("bad", "x @poison", steps=8))))
            return await asyncio.gather(*tasks)

        *peers, bad = asyncio.run(run())
        assert bad.error is not None and bad.error.status == 500
        assert bad.error.message == (
            "stage 'llm': request crashed the worker 3 times; it is not retried"
        )
        assert all(len(_text(p).split()) == 8 for p in peers)
        assert eng.stats.worker_deaths == 3
        assert pool.replicas[0].restarts == 0


def _chat(rid: str, text: str, **kw) -> OmniRequest:
    """A chat turn to the tiny LLM alone (stage 0 of tiny-omni)."""
    params = GenerationParams(messages=(("user", text),), **kw)
    return OmniRequest(rid, text, "tiny-omni", params, last_stage=0)


def test_the_llm_stage_steps_a_running_set_a_short_request_joins_and_leaves_first():
    """The real LLM stage (tiny-llm) runs its rows as a running set: a short rewrite sent while
    a long constrained reply decodes joins it at a step boundary, ends first with the text it
    makes alone, and the long one's text is its own too."""
    long_guide = GuideSpec("regex", "[a-z]{100}")  # 100 steps (a letter a token)
    with engine("tiny-omni", stage_kw={"max_batch_size": 8}) as eng:
        pool = eng.orchestrator.pools["tiny-omni"][0]
        alone = asyncio.run(final(eng, _chat("alone", "a red circle", max_new_tokens=40)))
        long_alone = asyncio.run(
            final(eng, _chat("l0", "spell", guide=long_guide, max_new_tokens=110))
        )
        assert pool.stepped == frozenset({"text"})

        async def run():
            running = asyncio.Event()
            request = _chat("long", "spell", guide=long_guide, max_new_tokens=110)
            long = asyncio.create_task(_running(eng, request, 5, running))
            await asyncio.wait_for(running.wait(), 60)
            short = await final(eng, _chat("short", "a red circle", max_new_tokens=40))
            assert not long.done(), "the short request waited for the long one to end"
            return short, await long

        short, long = asyncio.run(run())
        assert _text(short) == _text(alone)
        assert _text(long) == _text(long_alone) and len(_text(long)) == 100
        ran = {b.size for b in eng.batches if b.stage == "llm"}
        assert ran == {1}  # each request its own group of the set
        assert max(b.model_batch for b in eng.batches if b.stage == "llm") == 2  # one forward


def test_a_request_of_another_size_opens_a_lane_and_ends_long_before_the_set():
    """The tiny image model, one replica: a 3-step 48x48 request sent while a 40-step 64x64
    one denoises opens a second lane (`--shape-groups 2`); the lanes step in turn, so it ends
    while the long one still runs, with the image it makes alone."""
    kw = {"max_batch_size": 8, "shape_groups": 2}
    with engine("tiny-image", stage_kw=kw) as eng:
        pool = eng.orchestrator.pools["tiny-image"][0]

        def image(rid: str, steps: int, side: int) -> OmniRequest:
            return req(rid, "a red circle", "tiny-image", steps, seed=5, width=side, height=side)

        alone = asyncio.run(final(eng, image("alone", 3, 48)))
        assert pool.stepped and alone.ok

        async def run():
            running = asyncio.Event()
            long = asyncio.create_task(_running(eng, image("long", 40, 64), 2, running))
            await asyncio.wait_for(running.wait(), 60)
            short = await final(eng, image("short", 3, 48))
            assert not long.done(), "the short request waited for the long set to drain"
            return short, await long

        short, long = asyncio.run(run())
        assert long.ok and short.ok
        a, b = (o.output.images[0].pixels.astype(int) for o in (short, alone))
        assert abs(a - b).max() <= 1


def test_request_level_batching_takes_no_joins():
    """`--batch-level request`: the same stage runs each batch whole; a short request that
    arrives while a long one runs waits for it (the contract with no joins)."""
    with engine(stage_kind=TOKENS, stage_kw={"batch_level": "request"}) as eng:
        assert eng.orchestrator.pools["null-omni"][0].stepped == frozenset()

        async def run():
            running = asyncio.Event()
            long = asyncio.create_task(_running(eng, req("long", SLOW, steps=12), 2, running))
            await asyncio.wait_for(running.wait(), 30)
            short = await final(eng, req("short", "short one", steps=2))
            return short, await long

        short, long = asyncio.run(run())
        assert len(_text(short).split()) == 2 and len(_text(long).split()) == 12
        # the batches as the engine saw them end: the long one whole, then the short one
        ended = [(b.size, sorted(b.steps_run)) for b in eng.batches if b.stage == "llm"]
        assert ended == [(1, ["long"]), (1, ["short"])]
