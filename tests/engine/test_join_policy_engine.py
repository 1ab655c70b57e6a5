"""The one running-set policy (executor/join_policy.py) end to end: the real engine and real
worker processes of a stage with both kinds of group (tests/stage_helpers.py `LaneStepStage`:
text2img rows step as a running set, a lane a size; edits run whole), fed seeded random
arrivals. A traced executor records, in the engine's process, each group the engine sends (a
join or not, as the engine counted it) and what the worker says back; the trace must show that
no group waits at the worker while the engine counts it in the set, and that no join is sent
that the worker, as far as its own step reports show, has no room for."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from dataclasses import dataclass, field

import numpy as np
import pytest

from tests.engine.helpers import engine, final
from vllm_omni_like.executor import MultiprocExecutor
from vllm_omni_like.inputs import OmniRequest
from vllm_omni_like.outputs import OmniRequestOutput, RequestProgress
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.wire import (
    BatchDone,
    Denoised,
    ExecuteBatch,
    Held,
    Progress,
    ReplicaDied,
    StageRequest,
)

STAGE = "tests.stage_helpers:LaneStepStage"
STEPPED = frozenset({"text2img"})
PIPELINE = "null-image"


@dataclass
class _Group:
    """A group the worker's step reports showed stepping (and that has not left since)."""

    key: object
    whole: bool
    rows: set[str]  # its requests whose rows still step, as the reports say


@dataclass
class Trace:
    """What crossed between the engine and its workers, in the order the engine's process saw
    it: each group sent (with whether the engine sent it as a join) and each worker message."""

    lanes: int
    budget: int
    eng: object = None  # the engine whose pool the sends are read from
    events: list[tuple[int, object, bool]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def sent(self, replica: int, batch: ExecuteBatch) -> None:
        """On the orchestrator's thread, right after it counted the group in its replica."""
        pool = self.eng.orchestrator.pools[PIPELINE][0]
        joined = pool.replicas[replica].inflight[batch.batch_id].joined
        with self.lock:
            self.events.append((replica, batch, joined))

    def saw(self, replica: int, msg: object) -> None:
        with self.lock:
            self.events.append((replica, msg, False))

    def check(self) -> tuple[list[str], int, int]:
        """What broke the invariant (none: []), and how many joins and holds it saw. The
        worker's set is known from below: a group steps there once a step report names it, or
        from its sending when nothing else was in flight (the worker takes it at once, alone),
        until it leaves (`Denoised`, `BatchDone`)."""
        sent: dict[tuple[int, int], tuple[ExecuteBatch, bool]] = {}
        stepping: dict[tuple[int, int], _Group] = {}
        broken, joins, held = [], 0, 0
        for replica, msg, joined in list(self.events):
            match msg:
                case ExecuteBatch(batch_id=bid) as batch:
                    if joined:
                        joins += 1
                        ahead = [g for (r, _), g in stepping.items() if r == replica]
                        broken += [f"group {bid}: {why}" for why in self._no_room(ahead, batch)]
                    elif not any(r == replica for r, _ in sent):
                        stepping[replica, bid] = _group(batch)
                    sent[replica, bid] = (batch, joined)
                case Progress(batch_id=bid, joined=others, progress=rows):
                    for b in [bid, *others]:
                        group = stepping.setdefault((replica, b), _group(sent[replica, b][0]))
                        group.rows -= {r for r, (at, of) in (rows or {}).items() if at >= of}
                case Denoised(batch_id=bid) | BatchDone(batch_id=bid):
                    stepping.pop((replica, bid), None)
                    sent.pop((replica, bid), None)
                case Held(batch_id=bid):
                    held += 1
                    if sent[replica, bid][1]:
                        broken.append(f"group {bid}: a join held back at the worker")
                case ReplicaDied():
                    stepping = {k: g for k, g in stepping.items() if k[0] != replica}
                    sent = {k: v for k, v in sent.items() if k[0] != replica}
        return broken, joins, held

    def _no_room(self, ahead: list[_Group], batch: ExecuteBatch) -> list[str]:
        """Why the worker's set, as its reports show it, had no room for the join `batch`
        (lanes, rows, a whole batch), judged apart from the policy module."""
        why = []
        if any(g.whole for g in ahead):
            why.append("sent while the worker runs a whole batch")
        if len({g.key for g in ahead} | {_key(batch.requests[0])}) > self.lanes:
            why.append(f"a shape group past the {self.lanes} lanes stepping")
        if sum(len(g.rows) for g in ahead) + len(batch.requests) > self.budget:
            why.append(f"rows past the budget of {self.budget}")
        return why


def _key(request: StageRequest) -> object:
    return request.batch_key(STEPPED)


def _group(batch: ExecuteBatch) -> _Group:
    first = batch.requests[0]
    return _Group(_key(first), first.mode not in STEPPED, {r.request_id for r in batch.requests})


def _traced(trace: Trace) -> type[MultiprocExecutor]:
    class Traced(MultiprocExecutor):
        def __init__(self, config, replica, sink, faults=()) -> None:
            def seen(msg: object) -> None:
                trace.saw(replica, msg)
                sink(msg)

            super().__init__(config, replica, seen, faults)

        def execute(self, batch: ExecuteBatch) -> None:
            trace.sent(self.replica, batch)
            super().execute(batch)

        def add_failure_callback(self, callback) -> None:
            def seen(event: ReplicaDied) -> None:
                trace.saw(self.replica, event)
                callback(event)

            super().add_failure_callback(seen)

    return Traced


def _request(rid: str, side: int, steps: int, edit: bool = False, **kw) -> OmniRequest:
    """text2img rows of `side` (a lane each size), or an edit of it (a whole batch); each step
    20 ms."""
    params = GenerationParams(seed=7, num_inference_steps=steps, width=side, height=side, **kw)
    images = [np.zeros((side, side, 3), np.uint8)] if edit else []
    return OmniRequest(rid, f"{rid} @delay=0.02", PIPELINE, params, images=images)


def _arrivals(seed: int, count: int) -> list[tuple[float, OmniRequest]]:
    """Seeded random arrivals: gaps of 0-80 ms; three sizes; 2-8 steps; 1 or 2 images; with or
    without guidance (their work differs); one request in seven an edit."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        gap = rng.choice([0.0, 0.0, 0.01, 0.03, 0.08])
        side, steps = rng.choice([32, 48, 64]), rng.randint(2, 8)
        if rng.random() < 1 / 7:
            request = _request(f"e{i}", side, steps, edit=True)
        else:
            guidance = rng.choice([None, 1.0])
            n = rng.choice([1, 1, 2])
            request = _request(f"r{i}", side, steps, n=n, guidance_scale=guidance)
        out.append((gap, request))
    return out


async def _stream(eng, request: OmniRequest, stepped: asyncio.Event | None = None):
    """The request's final output; `stepped` is set at its first step."""
    async for event in eng.generate(request):
        if isinstance(event, RequestProgress) and stepped is not None:
            stepped.set()
        if isinstance(event, OmniRequestOutput):
            return event
    raise AssertionError("no final output")


@contextlib.contextmanager
def _traced_engine(stage_kw: dict):
    """One replica of the stand-in stage (`--shape-groups 2`, no batch wait, unless `stage_kw`
    says otherwise) behind a traced executor; after it ran: its trace, and that the engine
    never counted in the set a group the worker held back."""
    kw = {"max_batch_size": 3, "shape_groups": 2, "batch_wait": 0.0, **stage_kw}
    trace = Trace(kw["shape_groups"], kw["max_batch_size"])
    traced = _traced(trace)
    # (a burst is admitted whole: the stand-in's steps are slow for their few pixels)
    with engine(
        PIPELINE, stage_kw=kw, stage_kind=STAGE, executor_factory=traced, max_queue_seconds=1e5
    ) as eng:
        trace.eng = eng
        yield eng, trace
        replicas = eng.orchestrator.pools[PIPELINE][0].replicas
        assert [r.misjudged for r in replicas] == [[]] * len(replicas)


def _run(seed: int, count: int, **stage_kw) -> Trace:
    """Seeded random arrivals; each request ends whole."""
    arrivals = _arrivals(seed, count)
    with _traced_engine(stage_kw) as (eng, trace):

        async def run() -> list[OmniRequestOutput]:
            tasks = []
            for gap, request in arrivals:
                await asyncio.sleep(gap)  # (the arrival's time; nothing is read after it)
                tasks.append(asyncio.create_task(final(eng, request)))
            return await asyncio.wait_for(asyncio.gather(*tasks), 60)

        outs = asyncio.run(run())
    assert [o.error for o in outs if not o.ok] == []
    for (_, request), out in zip(arrivals, outs, strict=True):
        if not request.images:  # a token a step: the row ran its own steps, all of them
            tokens = next(iter(out.stage_outputs.values())).text.split()
            assert len(tokens) == request.params.num_inference_steps
    return trace


@pytest.mark.parametrize(("seed", "replica_queue"), [(1, 0), (2, 1)])
def test_random_arrivals_never_send_a_join_the_worker_holds_back(seed, replica_queue):
    """Seeded random arrivals over one replica (`--shape-groups 2`, `--max-batch-size 3`),
    with and without a group sent ahead (`--replica-queue`): every request ends whole, no
    join is sent into a set that its worker's reports show full (lanes, rows) or running a
    whole batch, the worker holds back none of the engine's joins, and the engine never
    counts in the set a group the worker holds back."""
    broken, joins, _ = _run(seed, 28, replica_queue=replica_queue).check()
    assert broken == []
    # with no group sent ahead, a request that arrives while a set runs can only join it (or
    # wait at the engine); the arrivals overlap, so some joined
    assert joins > 0 or replica_queue > 0


def _scenario(stage_kw: dict, first: OmniRequest, second: OmniRequest, late: OmniRequest):
    """`first` runs; `second` is sent once it stepped; `late` once `second` stepped too: the
    trace of the three (each of which ends whole)."""
    with _traced_engine({"max_batch_size": 4, **stage_kw}) as (eng, trace):

        async def run():
            tasks = []
            for request in (first, second):
                stepped = asyncio.Event()
                tasks.append(asyncio.create_task(_stream(eng, request, stepped)))
                await asyncio.wait_for(stepped.wait(), 30)
            tasks.append(asyncio.create_task(_stream(eng, late)))
            return await asyncio.wait_for(asyncio.gather(*tasks), 60)

        outs = asyncio.run(run())
    assert all(o.ok for o in outs), [o.error for o in outs]
    return trace


def test_a_group_sent_ahead_that_opened_a_lane_leaves_no_lane_for_a_join():
    """`--replica-queue 1`: a 64x64 set runs; a 48x48 group sent ahead opens the second lane
    at the worker; a 32x32 request then waits at the engine (both lanes are taken), not at the
    worker as a join it counts as stepping."""
    trace = _scenario(
        {"replica_queue": 1},
        _request("long", 64, 60),
        _request("ahead", 48, 60),
        _request("late", 32, 2),
    )
    broken, _, held = trace.check()
    assert broken == [] and held == 0


def test_nothing_joins_beside_a_whole_batch():
    """A whole batch (an edit) runs; a text2img request that arrives waits at the engine until
    it has ended, not at the worker as a join beside it; the same behind a 48x48 set with an
    edit sent ahead of it (it waits at the worker, which says so)."""
    trace = _scenario(
        {}, _request("edit", 64, 40, edit=True), _request("a", 48, 2), _request("b", 32, 2)
    )
    broken, _, _ = trace.check()
    assert broken == []
    trace = _scenario(
        {"replica_queue": 1},
        _request("set", 48, 60),
        _request("edit", 64, 4, edit=True),
        _request("late", 48, 2),
    )
    broken, _, held = trace.check()
    assert broken == [] and held == 1  # the edit, sent ahead, waited for the set to drain


@pytest.mark.drill
@pytest.mark.parametrize("seed", range(10, 18))
@pytest.mark.parametrize(
    "stage_kw",
    [
        {"replica_queue": 1, "shape_groups": 1},
        {"replica_queue": 2, "shape_groups": 3, "max_batch_size": 4},
        {"replica_queue": 1, "replicas": 2, "decode_overlap": False},
    ],
)
def test_random_arrivals_drill(seed, stage_kw):
    broken, _, _ = _run(seed, 60, **stage_kw).check()
    assert broken == []
