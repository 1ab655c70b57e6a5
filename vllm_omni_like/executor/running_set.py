"""The worker's running set: groups of rows join at step boundaries and leave as they end.

The rows of a stage that steps them (`Stage.stepper`), fed by the engine one group at a time
(an `ExecuteBatch`: the rows it adds), stepped together, each request leaving as its rows end.

- A group joins at the next step boundary the lane of its shape group, or opens a lane of its
  own beside the others, when the running-set policy (executor/join_policy.py, the one the
  engine sends joins by) admits it beside the groups ahead of it: lanes (`--shape-groups`),
  rows and work (`--max-batch-size`). Else it waits, in order, until there is room, and the
  worker says so (`Held`); only a group sent ahead (`--replica-queue`) ever waits, a join the
  engine sent always has room. A whole-batch group waits until every lane has drained and runs
  alone, as before; while one waits nothing joins.
- Lanes step one at a time, by an age rule: the lane that waited longest since its last step
  steps next, so a short request of another size is not stuck behind a long set, and a long
  set is slowed, not stopped, while it runs beside it.
- Every step advances every live row of its lane. A step that raises is bisected over the
  lane's requests (`stages/isolation.py`): halves step on their own from the same inputs (a
  step that raises commits nothing), so only the culprit fails and leaves; its peers go on. A
  join that raises is bisected the same way (its `execute` faults fire there).
- An aborted request's rows leave at the next step boundary; its peers are untouched.
- The requests that end at a step leave at once, their rest (the decode) one job for the
  finisher thread, which sends their results; a group none of whose requests is left leaves
  the critical path (`Denoised`) with that job, and its `BatchDone` follows its last results.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field

from vllm_omni_like.executor.join_policy import GroupLoad, JoinPolicy
from vllm_omni_like.outputs import StageOutput
from vllm_omni_like.stages.base import Deferred, RowStepper, Stage, StageControl
from vllm_omni_like.stages.isolation import bisect_isolated
from vllm_omni_like.wire import ExecuteBatch, Mode, StageRequest


@dataclass
class Group:
    """One ExecuteBatch's requests in the set."""

    batch_id: int
    ids: list[str]
    started: float
    left: set[str] = field(default_factory=set)  # still to leave
    units: float = 0.0  # the work of one step of all its requests (the policy's)


@dataclass
class Job:
    """One batch in this worker (or what left a running set at one step): begun on the main
    thread, maybe finished on the finisher."""

    batch_id: int
    ids: list[str]
    started: float
    model_batch: int = 0
    parts: list[Deferred | StageOutput] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    # a running set's: the group (batch id) of each request it finishes, and the groups it
    # ends (their Denoised and BatchDone); None for a whole batch (`batch_id` is its group)
    owners: dict[str, int] = field(default_factory=dict)
    groups: list[Group] | None = None

    def owner(self, request_id: str) -> int:
        return self.owners.get(request_id, self.batch_id)

    def ends(self) -> list[tuple[int, list[str], float]]:
        """(batch id, request ids, start) of each group whose last requests it finishes."""
        if self.groups is None:
            return [(self.batch_id, self.ids, self.started)]
        return [(g.batch_id, g.ids, g.started) for g in self.groups]


# what left at one step boundary: the requests that ended (their rest), the groups that ended,
# and the group of each request that ended
HandOver = Callable[[Deferred | None, list[Group], dict[str, int]], None]


@dataclass
class Lane:
    """The rows of one shape group: their stepper and their groups, oldest first."""

    stepper: RowStepper
    waited: float  # since when it waits for its next step (its last step, or its opening)
    key: Hashable = ()  # its shape group
    groups: dict[int, Group] = field(default_factory=dict)

    @property
    def batch_ids(self) -> list[int]:
        return list(self.groups)


class RunningSet:
    def __init__(
        self,
        stage: Stage,
        control: StageControl,
        deliver: Callable[[int, StageOutput], None],
        hand_over: HandOver,
        validate: Callable[[ExecuteBatch], list[StageRequest]],
        stepped: tuple[Mode, ...],
        policy: JoinPolicy,
    ) -> None:
        self.stage = stage
        self.control = control
        self.deliver = deliver  # (batch id, output): a culprit's error, out at once
        self.hand_over = hand_over
        self.validate = validate  # the group's valid requests (the others answered)
        self.stepped = stepped  # the modes whose rows run as a set (none: whole batches)
        self.policy = policy
        self.lanes: list[Lane] = []  # in the order they opened
        self.lane_of: dict[int, Lane] = {}  # a group's batch id -> its lane
        self.group_of: dict[str, int] = {}  # request id -> its group's batch id
        self.waiting: deque[ExecuteBatch] = deque()  # groups that cannot join yet, in order

    @property
    def running(self) -> bool:
        return bool(self.lanes)

    def takes(self, batch: ExecuteBatch) -> bool:
        """Whether `batch` goes to the set (to join it, or to wait for it to drain); the worker
        runs the others whole, as before."""
        return self.running or self._stepped(batch)

    def _stepped(self, batch: ExecuteBatch) -> bool:
        return bool(batch.requests) and batch.requests[0].loop_mode in self.stepped

    def add(self, batch: ExecuteBatch) -> bool:
        """A group that arrived: it joins its lane (or opens one) now if the policy admits it
        beside every group ahead of it, in the set or waiting; else it waits (False)."""
        if self._admits(batch, self._placed() + [self._load(b)[0] for b in self.waiting]):
            self.place(batch)
            return True
        self.waiting.append(batch)
        return False

    def next_waiting(self) -> ExecuteBatch | None:
        """The first group that waited, once the policy admits it beside the set (a whole
        batch: once every lane has drained): the caller places it, or runs it whole."""
        if not self.waiting or not self._admits(self.waiting[0], self._placed()):
            return None
        return self.waiting.popleft()

    def place(self, batch: ExecuteBatch) -> None:
        """An admitted group joins the lane of its shape group, or opens one."""
        load = self._load(batch)[0]
        lane = next((lane for lane in self.lanes if lane.key == load.key), None)
        if lane is None:
            assert len(self.lanes) < self.policy.lanes  # (the policy counted the lanes)
            if not self.lanes:
                self.control.max_model_batch = 0
            stepper = self.stage.stepper(batch.requests[0].loop_mode)
            assert stepper is not None
            lane = Lane(stepper, time.monotonic(), load.key)
            self.lanes.append(lane)
        self._join(lane, batch, load.units)

    def _load(self, batch: ExecuteBatch) -> tuple[GroupLoad, list[float]]:
        """The group as the policy sees it (as the engine does: its key, its requests' work),
        and each request's work a step."""
        units = [self.policy.units(r.params) for r in batch.requests]
        key = batch.requests[0].batch_key(frozenset(self.stepped)) if batch.requests else ()
        n = len(units)
        return GroupLoad(key, not self._stepped(batch), n, n, sum(units)), units

    def _placed(self) -> list[GroupLoad]:
        """The groups in the set, each with its rows still stepping."""
        loads = []
        for lane in self.lanes:
            stepping = {r.request_id for r in lane.stepper.stepping}
            for g in lane.groups.values():
                loads.append(
                    GroupLoad(lane.key, False, len(g.ids), len(g.left & stepping), g.units)
                )
        return loads

    def _admits(self, batch: ExecuteBatch, ahead: list[GroupLoad]) -> bool:
        group, units = self._load(batch)
        return self.policy.admits(ahead, group, units)

    def _join(self, lane: Lane, batch: ExecuteBatch, units: float) -> None:
        stepper = lane.stepper
        ids = [r.request_id for r in batch.requests]
        group = Group(batch.batch_id, ids, time.monotonic(), units=units)
        lane.groups[batch.batch_id] = group
        self.lane_of[batch.batch_id] = lane
        for rid in group.ids:
            self.group_of[rid] = batch.batch_id
        valid = self.validate(batch)
        group.left = {r.request_id for r in valid}

        def join(live: list[StageRequest]) -> list[StageOutput]:
            self.control.faults.fire("execute", live)
            stepper.join(live, self.control)
            return []

        with self._early():
            bisect_isolated(self.stage.name, valid, self.control, join, self._culprit)
        self._settle(lane, None)

    def next_lane(self) -> Lane:
        """The age rule: the lane that has waited longest since its last step."""
        return min(self.lanes, key=lambda lane: lane.waited)

    def step(self, lane: Lane) -> None:
        """One step of `lane`, then whatever ended leaves."""
        stepper = lane.stepper

        def step(live: list[StageRequest]) -> list[StageOutput]:
            stepper.step(self.control, {r.request_id for r in live})
            return []

        with self._early():
            bisect_isolated(self.stage.name, stepper.requests, self.control, step, self._culprit)
        lane.waited = time.monotonic()
        self._settle(lane, stepper.leave(self.control))

    @contextlib.contextmanager
    def _early(self) -> Iterator[None]:
        """A row's output that the stage delivers before the row leaves (an LLM row that failed
        at its join) goes out at once, to its group."""
        self.control.report = lambda out: self.deliver(self.group_of[out.request_id], out)
        try:
            yield
        finally:
            self.control.report = None

    def _culprit(self, out: StageOutput) -> None:
        """A request whose join or step raised alone: its error goes out, it leaves the set."""
        batch_id = self.group_of[out.request_id]
        self.lane_of[batch_id].stepper.drop({out.request_id})
        self.deliver(batch_id, out)

    def _settle(self, lane: Lane, part: Deferred | None) -> None:
        """Hand over what left the lane: the requests of `part` (ended at this step) and the
        groups none of whose requests is in it any more, oldest first; a drained lane closes."""
        owners = (
            {}
            if part is None
            else {r.request_id: self.group_of[r.request_id] for r in part.requests}
        )
        inside = {r.request_id for r in lane.stepper.requests}
        ended = []
        for batch_id in list(lane.groups):
            group = lane.groups[batch_id]
            group.left &= inside
            if not group.left:
                del lane.groups[batch_id]
                del self.lane_of[batch_id]
                for rid in group.ids:
                    self.group_of.pop(rid, None)
                ended.append(group)
        if not lane.groups:
            self.lanes.remove(lane)
        if part is not None or ended:
            self.hand_over(part, ended, owners)
