"""The one cost model (cost.py): units of work, measured speed, admission in seconds of work,
queued batches on replicas, and routing by cost against routing by count."""

from __future__ import annotations

import asyncio
import math
import time
from types import SimpleNamespace

import pytest

from tests.conftest import wait_for
from tests.engine.helpers import engine, final, gather, req
from vllm_omni_like.cost import Speed, parallel_rate, step_units, work_units
from vllm_omni_like.engine.admission import Admission
from vllm_omni_like.engine.replica import InFlight, Replica
from vllm_omni_like.engine.routing import choose
from vllm_omni_like.engine.snapshot import StageView, drain_seconds
from vllm_omni_like.engine.stall import StepClock
from vllm_omni_like.errors import QueueFullError
from vllm_omni_like.executor.join_policy import JoinPolicy
from vllm_omni_like.executor.start_method import START_ENV
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.wire import Progress


def test_units_are_pixels_frames_images_and_the_guidance_branch():
    p = GenerationParams(width=64, height=32, n=2, guidance_scale=7.5)
    assert step_units(p) == 64 * 32 * 2 * 2
    assert step_units(GenerationParams(width=64, height=32, guidance_scale=1.0)) == 64 * 32
    video = GenerationParams(width=64, height=32, num_frames=9, guidance_scale=5.0)
    assert step_units(video) == 64 * 32 * 9 * 2
    assert (
        work_units(GenerationParams(width=8, height=8, num_inference_steps=5), 20) == 8 * 8 * 2 * 5
    )
    assert work_units(GenerationParams(width=8, height=8), 20) == 8 * 8 * 2 * 20  # the default
    text = GenerationParams(width=512, height=512, max_new_tokens=7)
    assert step_units(text, text=True) == 1.0 and work_units(text, 24, text=True) == 7


def test_speed_calibrates_on_steps_and_replicas_side_by_side_add_up():
    speed = Speed()
    assert speed.seconds(100) is None
    speed.sample(1.0, 1000)  # 1 ms per unit
    assert speed.seconds(100) == pytest.approx(0.1)
    speed.sample(3.0, 1000)  # the newest step weighs EMA = 0.3
    assert speed.rate == pytest.approx(0.7 * 1e-3 + 0.3 * 3e-3)
    assert parallel_rate([None, None]) is None
    assert parallel_rate([2e-3, 2e-3]) == pytest.approx(1e-3)  # two equal replicas: twice as fast
    assert parallel_rate([1e-3, None]) == pytest.approx(1e-3)


def _view(rate: float | None, text: bool = False, steps: int = 4) -> StageView:
    return StageView("p", "s", "ready", 0, 0, 1, 1, 0, text=text, default_steps=steps, rate=rate)


def test_admission_counts_seconds_of_work_and_says_when_to_come_back():
    stages = (_view(None, text=True), _view(1e-3))  # an LLM stage not measured, a diffusion one
    admission = Admission(max_requests=100, max_seconds=1.0)
    units = (24.0, 300.0)  # 0.3 s at the diffusion stage
    for _ in range(3):
        admission.admit("p", units, stages)
    assert drain_seconds(admission.held("p")[1], stages) == pytest.approx(0.9)
    with pytest.raises(QueueFullError) as refused:
        admission.admit("p", units, stages)  # 1.2 s > 1.0 s
    assert refused.value.retry_after == 1  # 0.2 s over, in whole seconds
    assert (
        "0.9s of work" in refused.value.message and "--max-queue-seconds 1" in refused.value.message
    )
    admission.admit("p", (24.0, 50.0), stages)  # a small one still fits: 0.95 s
    admission.release("p", units)
    admission.admit("p", units, stages)  # room again
    big = Admission(max_requests=100, max_seconds=1.0)
    big.admit("p", (1.0, 5000.0), stages)  # 5 s alone: a request alone is always admitted
    with pytest.raises(QueueFullError) as refused:
        big.admit("p", (1.0, 1.0), stages)
    assert refused.value.retry_after == 5  # 5.001 s held - 1 s allowed, rounded up
    big.release("p", (1.0, 5000.0))  # its end releases exactly what it held
    assert big.held("p") == (0, (0.0, 0.0))


def test_admission_before_any_measurement_counts_requests_only():
    admission = Admission(max_requests=2, max_seconds=0.001)
    stages = (_view(None),)
    admission.admit("p", (1e9,), stages)
    admission.admit("p", (1e9,), stages)  # no speed measured: the seconds bound cannot apply
    with pytest.raises(QueueFullError, match="--max-queue-size") as refused:
        admission.admit("p", (1.0,), stages)
    assert refused.value.retry_after == 1


def _replica(index: int, credits: int = 4, rate: float | None = None) -> Replica:
    clock = StepClock(60.0, 600.0, 120.0)
    clock.speed.rate = rate
    r = Replica(index, max_credits=credits, clock=clock)
    r.executor = type("Alive", (), {"alive": True})()
    return r


def _batch(bid: int, units: float, steps: int = 4, now: float = 0.0, whole=False) -> InFlight:
    return InFlight(bid, [object()], now, units=units, steps=steps, whole=whole)


def _room(r: Replica, key, units: float, budget: int, lanes: int = 1) -> int:
    """How many requests of `units` a step each of shape group `key` may join `r`'s set."""
    return r.joinable(key, [units] * budget, JoinPolicy(lanes, budget))


def test_credits_queue_batches_and_the_next_starts_when_the_one_before_is_denoised():
    r = _replica(0, credits=2)
    r.dispatched(_batch(1, 10.0, now=1.0, whole=True))
    r.dispatched(_batch(2, 20.0, now=1.5, whole=True))  # queued behind batch 1
    assert r.credits == 0 and not r.can_take
    assert r.critical.batch_id == 1 and r.clock.units == 10.0 and r.clock.last_step == 1.0
    assert r.outstanding() == (2, 10.0 * 4 + 20.0 * 4)
    r.progress(Progress(1, [], 3, 4), now=2.0)  # one step left of batch 1
    assert r.outstanding() == (2, 10.0 + 80.0)
    r.progress(Progress(2, [], 1, 4), now=2.1)  # a queued batch's report does not move the clock
    assert r.clock.last_step == 2.0
    r.denoised(1, now=3.0)  # batch 2 runs from now: the stall bound counts from here
    assert r.critical.batch_id == 2 and r.clock.units == 20.0 and r.clock.last_step == 3.0
    assert r.credits == 1 and r.can_take  # one being finished, one running: room for one more
    r.done(1, now=3.5)
    r.done(2, now=4.0)  # never denoised (no overlap): its end returns its credit
    assert r.credits == 2 and r.inflight == {} and r.outstanding() == (0, 0.0)


def test_routing_by_cost_looks_at_work_and_speed_by_count_at_requests():
    a, b = _replica(0), _replica(1)
    a.dispatched(_batch(1, 1000.0))  # one big batch
    for bid in (2, 3):
        b.dispatched(_batch(bid, 10.0))  # two small ones
    assert choose([a, b], 10.0, "count") is a  # fewer requests
    assert choose([a, b], 10.0, "cost") is b  # far less work
    fast, slow = _replica(2, rate=1e-3), _replica(3, rate=4e-3)
    assert choose([fast, slow], 40.0, "cost") is fast  # both idle: 0.04 s against 0.16 s
    fast.dispatched(_batch(4, 100.0))  # 400 units queued on the fast one
    assert choose([fast, slow], 40.0, "cost") is slow  # 0.44 s against 0.16 s
    assert choose([fast, slow], 40.0, "count") is slow  # (and the slow one holds nothing)


NULL_SPEED = {"steps": 4, "step_s_per_munit": 0.5}  # a step of 256x256 with CFG: 66 ms


def _mixed(prefix: str) -> list:
    """Alternating big (256x256) and small (128x128) images: 4 of each."""
    return [
        req(f"{prefix}{i}", pipeline="null-image", steps=4, seed=i, width=s, height=s)
        for i, s in enumerate([256, 128] * 4)
    ]


async def _makespan(eng, requests) -> float:
    t0 = time.monotonic()
    outs = await gather(eng, requests)
    assert all(o.ok for o in outs), [o.error for o in outs]
    return time.monotonic() - t0


@pytest.mark.parametrize("replica_queue", [3])
def test_a_mixed_workload_ends_sooner_routed_by_cost_than_by_count(replica_queue):
    """Replicas that hold queued work (credits) make routing matter: count-based routing puts
    every big image on one replica of two (the alternating arrivals tie it each time), the
    cost model spreads the work."""
    spans = {}
    for routing in ("count", "cost"):
        kw = {
            "replicas": 2,
            "max_batch_size": 1,
            "replica_queue": replica_queue,
            "routing": routing,
            "batch_wait": 0.0,
            "options": dict(NULL_SPEED),
        }
        with engine("null-image", stage_kw=kw) as eng:
            pool = eng.orchestrator.pools["null-image"][0]
            asyncio.run(final(eng, req(f"warm-{routing}", pipeline="null-image", steps=1)))
            spans[routing] = asyncio.run(_makespan(eng, _mixed(routing)))
            idle = pool.replicas
            wait_for(lambda r=idle: all(not x.inflight for x in r), 5, "replicas idle")
    # count: 4 x 0.26 s of big images on one replica; cost: about half of all the work on each
    assert spans["cost"] < 0.8 * spans["count"], spans
    assert spans["count"] > 4 * 4 * 0.066, spans


async def _admitted_until_refused(eng, side: int, prefix: str) -> tuple[int, QueueFullError]:
    """Submit (without waiting) requests of `side` x `side` until one is refused."""
    streams = []
    for i in range(60):
        try:
            streams.append(
                eng.open(
                    req(f"{prefix}{i}", pipeline="null-image", steps=4, width=side, height=side)
                )
            )
        except QueueFullError as exc:
            for s in streams:
                s.close()
            return len(streams), exc
    raise AssertionError("never refused")


def _fits(held: float, units: float, rate: float, limit: float) -> tuple[int, float]:
    """Admission's arithmetic (admission.py): how many requests of `units` each are taken in
    beside `held` units, each while all it holds with it drains within `limit` seconds at
    `rate`; and the units held when the next is refused."""
    n = 0
    while (held + units) * rate <= limit:
        held, n = held + units, n + 1
    return n, held


def test_the_engine_admits_seconds_of_work_not_a_number_of_requests(tmp_path, monkeypatch):
    """At the speed the replica measured, 2 s of 128x128 images are 4x as many requests as 2 s
    of 256x256 ones; the refusal says how long to wait, in seconds of that work.

    A request held at the replica's gate (GatedStage) keeps the rest queued: while requests are
    admitted nothing drains and no step changes the measured rate, so what fits is what that
    rate says, however fast or loaded the machine is."""
    kw = {"max_batch_size": 1, "batch_wait": 0.0, "options": dict(NULL_SPEED)}
    monkeypatch.setenv(START_ENV, "spawn")  # a null stage's double: no torch to preload
    gate = tmp_path / "gate"
    doubles = "tests.engine.stage_doubles:GatedStage"
    with engine("null-image", stage_kw=kw, stage_kind=doubles, max_queue_seconds=2.0) as eng:

        def stage() -> StageView:
            return eng.orchestrator.snapshot.stages[0]

        def held() -> tuple[int, tuple[float, ...]]:
            return eng.orchestrator.admission.held("null-image")

        async def scenario():
            # calibrate on steps that the null stage's sleep dominates (66 ms each)
            calibrate = req("calibrate", pipeline="null-image", steps=4, width=256, height=256)
            await final(eng, calibrate)
            hold = eng.open(
                req("hold", f"@gate={gate}", pipeline="null-image", steps=1, width=8, height=8),
                progress=False,
            )
            try:
                # running alone, published with the rate measured up to the calibration's end
                wait_for(lambda: stage().running == held()[0] == 1, 10, "the hold alone, running")
                rate, (_, (base,)) = stage().rate, held()
                small, refused = await _admitted_until_refused(eng, 128, "s")
                wait_for(lambda: held()[0] == 1, 10, "the small ones aborted")
                big, _ = await _admitted_until_refused(eng, 256, "b")
                wait_for(lambda: held()[0] == 1, 10, "the big ones aborted")
                assert stage().rate == rate  # nothing ran meanwhile: the same measured speed
            finally:
                gate.touch()  # (a failed check leaves no batch waiting at the gate)
            out = await hold.next(timeout=30)
            assert out.ok, out.error
            return rate, base, small, refused, big

        rate, base, small, refused, big = asyncio.run(scenario())
        wait_for(lambda: held()[0] == 0, 10, "drained")
    assert rate is not None
    u128, u256 = 128 * 128 * 2 * 4, 256 * 256 * 2 * 4  # a request's units: 4 steps with CFG
    fits_small, at_refusal = _fits(base, u128, rate, 2.0)
    fits_big, _ = _fits(base, u256, rate, 2.0)
    assert (small, big) == (fits_small, fits_big), (small, big, rate)
    # the same seconds hold 4x as many requests of a quarter of the work (x4 + 0..3 left over)
    assert 4 * big <= small <= 4 * big + 3, (small, big)
    over = (at_refusal + u128) * rate - 2.0
    assert refused.retry_after == max(1, math.ceil(over))  # whole seconds over the bound
    assert f"holds {at_refusal * rate:.1f}s of work" in refused.message
    assert "--max-queue-seconds 2;" in refused.message


def test_a_running_sets_clock_counts_its_groups_and_its_credit_passes_to_a_joined_group():
    r = _replica(0, credits=1)
    r.dispatched(_batch(1, 10.0, now=1.0))  # the set's first group: it spends the credit
    assert r.credits == 0 and r.clock.units == 10.0
    first = InFlight(2, [object()], 1.5, units=5.0, steps=4, joined=True, key=())
    r.dispatched(first)  # joins: no credit, its work joins the step's
    assert r.credits == 0 and r.clock.units == 15.0 and first.started == 1.5
    assert r.clock.last_step == 1.0  # a join does not restart the stall clock
    r.progress(Progress(1, [], 2, 4, joined=[2]), now=2.0)  # one report for both groups
    assert r.inflight[1].steps_done == 2 and r.inflight[2].steps_done == 2
    r.denoised(1, now=3.0)  # the first group leaves; the set goes on with the joined one
    assert r.credits == 0 and r.clock.units == 5.0 and not first.joined  # it holds the credit
    r.denoised(2, now=4.0)  # the set drained: its credit comes back
    assert r.credits == 1 and r.clock.units == 5.0  # (its last step's work: the expected step)


def test_a_request_whose_rows_ended_frees_its_row_at_once_though_its_decode_waits():
    """Rows end in the set (the worker's report says so: its own step reached its total)
    before their group's decode (the group leaves the critical path later): their row and
    work are free for a joining group at once, and the stall clock's units drop with them."""
    r = _replica(0, credits=1)
    a, b = (SimpleNamespace(request_id=rid, cohort=None) for rid in "ab")
    group = InFlight(1, [a, b], 1.0, units=4.0, steps=10, key=("k",))
    r.dispatched(group)
    assert _room(r, ("k",), 2.0, 3) == 1 and r.clock.units == 4.0
    r.progress(Progress(1, ["a", "b"], 3, 10, progress={"a": (3, 3), "b": (3, 10)}), now=2.0)
    assert group.ended == {"a"} and group.rows == 1
    assert _room(r, ("k",), 2.0, 3) == 2  # a's row is free: it left the set
    assert r.clock.units == 2.0  # one of its two requests still steps
    assert r.credits == 0 and group.denoised is None  # the group itself has not left


def test_a_batch_sent_ahead_that_the_worker_joins_to_its_set_starts_at_that_step():
    """With `--replica-queue 1` a batch is sent ahead of the running set: queued (its credit
    spent, not started) until the worker's step report names it among the set's groups; from
    that step its work is the set's (the stall clock's units) and it counts as running."""
    r = _replica(0, credits=2)
    r.dispatched(_batch(1, 10.0, now=1.0))
    ahead = _batch(2, 4.0, now=1.2)
    r.dispatched(ahead)
    assert r.credits == 0 and ahead.started is None and r.clock.units == 10.0
    assert r.outstanding() == (2, 10.0 * 4 + 4.0 * 4)
    r.progress(Progress(1, [], 1, 4), now=2.0)  # a step of the first group alone
    assert ahead.started is None and r.clock.units == 10.0
    r.progress(Progress(1, [], 2, 4, joined=[2]), now=3.0)  # the worker joined it
    assert ahead.started == 3.0 and r.clock.units == 14.0
    r.denoised(1, now=4.0)  # the first group leaves: its credit comes back, the set goes on
    assert r.credits == 1 and r.clock.units == 4.0
    r.denoised(2, now=5.0)
    assert r.credits == 2


def test_only_a_group_of_the_running_sets_shape_group_may_join_and_up_to_its_budget():
    r = _replica(0, credits=1)
    queued = [SimpleNamespace(cohort=None), SimpleNamespace(cohort=None)]
    r.dispatched(InFlight(1, queued, 1.0, units=2.0, key=("a",)))
    assert _room(r, ("a",), 1.0, 4) == 2  # two requests in the set, room for two more
    assert _room(r, ("a",), 1.5, 4) == 2  # 2 + 2 x 1.5 <= 4 x 1.5
    assert _room(r, ("a",), 0.6, 4) == 0  # its work is over 4 requests' of 0.6 already
    assert _room(r, ("b",), 1.0, 4) == 0  # one lane: another shape group waits
    # two lanes: another shape group opens one, within the rows left; its lane's work is its own
    assert _room(r, ("b",), 1.0, 4, 2) == 2
    assert _room(r, ("b",), 5.0, 4, 2) == 2  # (the set's 2.0 is another lane's)
    r.dispatched(
        InFlight(2, [SimpleNamespace(cohort=None)], 1.5, units=1.0, key=("b",), joined=True)
    )
    assert _room(r, ("c",), 1.0, 4, 2) == 0  # both lanes are taken
    assert _room(r, ("b",), 1.0, 4, 2) == 1  # 3 of the 4 rows are in the set
    idle = _replica(1)
    assert _room(idle, ("a",), 1.0, 4) == 0  # no set to join (it takes a new batch)


def _group(bid: int, key, joined: bool = False, whole: bool = False) -> InFlight:
    requests = [SimpleNamespace(cohort=None)]
    return InFlight(bid, requests, 1.0, units=1.0, key=key, joined=joined, whole=whole)


def test_a_join_counts_the_groups_sent_ahead_and_nothing_joins_a_whole_batch():
    """The worker may have let a group sent ahead into its set before a step report says so:
    ahead of a join it counts (a lane, its rows). A whole batch runs alone: nothing joins it."""
    r = _replica(0, credits=2)
    r.dispatched(_group(1, ("a",)))
    r.dispatched(_group(2, ("b",)))  # sent ahead: not started
    assert r.inflight[2].started is None
    assert _room(r, ("c",), 1.0, 4, 2) == 0  # its lane may be open at the worker
    assert _room(r, ("a",), 1.0, 4, 2) == 2  # and its row taken
    whole = _replica(1, credits=1)
    whole.dispatched(_group(3, ("edit",), whole=True))
    assert _room(whole, ("a",), 1.0, 4, 2) == 0


def test_a_group_sent_ahead_starts_when_a_step_report_names_it():
    """Sent ahead of others, a group may wait at the worker for room (`Held`): it starts when
    a report names it, in a lane of its own or another's; a join the worker held back would be
    the policy's views disagreeing: counted, and no longer counted in the set."""
    r = _replica(0, credits=3)
    for bid, key in ((1, "a"), (2, "b"), (3, "c")):
        r.dispatched(_group(bid, (key,)))
    r.denoised(1, now=2.0)
    assert r.inflight[2].started is None  # (3 is on the path too: 2 may still wait)
    assert r.held(2) and r.misjudged == []  # the worker says it waits, as counted
    r.progress(Progress(2, [], 1, 4), now=3.0)  # a step of its own lane
    assert r.inflight[2].started == 3.0
    r.dispatched(_group(4, ("b",), joined=True))
    assert not r.held(4) and r.misjudged == [4] and r.inflight[4].started is None
