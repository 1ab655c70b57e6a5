"""The running-set policy (executor/join_policy.py) alone, and the worker's running set asking
it: lanes, rows and work; a whole batch runs alone; the room never shrinks when the groups
ahead do (why a join the engine sends always finds room at the worker); a group sent ahead
waits at the worker, in order, until the policy admits it."""

from __future__ import annotations

import random

from tests.stage_helpers import LaneStepStage
from vllm_omni_like.executor.join_policy import GroupLoad, JoinPolicy
from vllm_omni_like.executor.running_set import RunningSet
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.pipelines.catalog import resolve
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.wire import ExecuteBatch, StageRequest


def _g(key: str, rows: int, units: float = 1.0, requests: int | None = None, whole=False):
    requests = rows if requests is None else requests
    return GroupLoad(key, whole, requests, rows, units * requests)


def test_a_set_takes_groups_up_to_its_lanes_rows_and_work():
    policy = JoinPolicy(lanes=2, budget=4)
    assert policy.room([], "a", [1.0]) == 0  # no set to join: an idle replica takes a batch
    assert policy.room([_g("a", 2)], "a", [1.0] * 4) == 2  # rows: 2 of 4 taken
    assert policy.room([_g("a", 2)], "b", [1.0] * 4) == 2  # a second lane
    assert policy.room([_g("a", 1), _g("b", 1)], "c", [1.0]) == 0  # a third: past the lanes
    # a lane's work: 4 requests of the first joiner's; requests of more work fit fewer, in order
    assert policy.room([_g("a", 1, units=2.0)], "a", [1.0, 3.0, 1.0]) == 1
    assert policy.room([_g("a", 1, units=2.0)], "a", [3.0, 3.0, 3.0]) == 3
    # a request whose rows ended frees its row and its share of the work at once
    assert policy.room([_g("a", 1, units=3.0, requests=2)], "a", [3.0] * 4) == 3


def test_a_whole_batch_runs_alone_and_any_group_starts_an_empty_set():
    policy = JoinPolicy(lanes=2, budget=4)
    whole = _g("edit", 1, whole=True)
    assert policy.room([whole], "a", [1.0]) == 0
    assert not policy.admits([whole], _g("a", 1), [1.0])
    assert not policy.admits([_g("a", 1)], whole, [1.0])
    assert policy.admits([], whole, [1.0])
    assert policy.admits([], _g("a", 9), [1.0] * 9)  # (the engine batched it: it starts a set)


def test_the_room_never_shrinks_when_the_groups_ahead_do():
    """What the worker sees ahead of a group is a part of what the engine saw when it sent it,
    with no more rows each: whatever the engine's view admits, the worker's admits."""
    rng = random.Random(5)
    policy = JoinPolicy(lanes=2, budget=6)
    for _ in range(3000):
        ahead = []
        for _ in range(rng.randint(1, 4)):
            n = rng.randint(1, 3)
            ahead.append(_g(rng.choice("abc"), rng.randint(0, n), rng.choice([1.0, 2.0]), n))
        units = [rng.choice([1.0, 2.0, 4.0, 1 / 3]) for _ in range(rng.randint(1, 6))]
        key = rng.choice("abc")
        room = policy.room(ahead, key, units)
        kept = [
            GroupLoad(g.key, g.whole, g.requests, rng.randint(0, g.rows), g.units)
            for g in ahead
            if rng.random() < 0.7
        ]
        if kept:
            assert policy.room(kept, key, units[:room]) == room, (ahead, kept, key, units)


def _set(lanes: int, budget: int) -> tuple[RunningSet, list[int]]:
    """A worker's running set over a token-like stage (text2img steps, edits run whole), and
    the groups that left it, in order."""
    config = resolve("null-image")[0].stages[0]
    stage = LaneStepStage(config)
    stage.load("cpu")
    left: list[int] = []
    rows = RunningSet(
        stage,
        StageControl(FaultInjector((), config.name)),
        lambda batch_id, out: None,
        lambda part, ended, owners: left.extend(g.batch_id for g in ended),
        lambda batch: list(batch.requests),
        stage.stepped_modes(),
        JoinPolicy(lanes, budget),
    )
    return rows, left


def _batch(bid: int, steps: list[int], side: int = 32, mode: str = "text2img") -> ExecuteBatch:
    params = [GenerationParams(num_inference_steps=s, width=side, height=side) for s in steps]
    return ExecuteBatch(
        bid, [StageRequest(f"{bid}.{i}", "x", p, mode) for i, p in enumerate(params)]
    )


def _drain(rows: RunningSet, steps: int) -> None:
    for _ in range(steps):
        rows.step(rows.next_lane())


def test_a_group_sent_ahead_waits_at_the_worker_in_order_until_rows_end():
    rows, left = _set(lanes=2, budget=2)
    assert rows.add(_batch(1, [2]))
    assert not rows.add(_batch(2, [3, 3]))  # 1 + 2 rows: past the budget; it waits
    assert not rows.add(_batch(3, [2], side=48))  # the waiting group's rows count ahead of it
    _drain(rows, 1)
    assert rows.next_waiting() is None  # (the row still steps)
    _drain(rows, 1)
    assert left == [1] and not rows.running
    waiting = rows.next_waiting()
    assert waiting is not None and waiting.batch_id == 2
    rows.place(waiting)
    assert rows.next_waiting() is None  # its two rows fill the set
    assert [lane.batch_ids for lane in rows.lanes] == [[2]]


def test_while_a_whole_batch_waits_nothing_joins_and_it_runs_once_the_set_drained():
    rows, _ = _set(lanes=2, budget=4)
    assert rows.add(_batch(1, [2]))
    edit = _batch(2, [2], mode="edit")
    assert rows.takes(edit) and not rows.add(edit)
    assert not rows.add(_batch(3, [2]))  # its lane is open, but a whole batch is ahead
    _drain(rows, 2)
    assert rows.next_waiting() is edit and not rows.takes(edit)  # (the worker runs it whole)
    later = rows.next_waiting()
    assert later is not None and later.batch_id == 3
