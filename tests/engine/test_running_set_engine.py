"""The running-set contract through the engine, real worker processes: a stage that steps
token-like rows (tests/stage_helpers.py `TokenStepStage`, not diffusion) takes a request into
its running set at the next step boundary instead of after the batch; an aborted row and a
row whose step fails leave alone, their peers finish with what they make alone."""

from __future__ import annotations

import asyncio
import time

from tests.engine.helpers import engine, final, req, steps_of
from vllm_omni_like.errors import ErrorKind
from vllm_omni_like.inputs import OmniRequest
from vllm_omni_like.outputs import OmniRequestOutput, RequestProgress

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
