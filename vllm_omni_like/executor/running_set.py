"""The worker's running set: the rows of a stage that steps them (`Stage.stepper`), fed by the
engine one group at a time (an `ExecuteBatch`: the rows it adds), stepped together, each
request leaving as its rows end.

- A group joins at the next step boundary if the set takes its shape group (`accepts`); else
  it waits, in order, until the set has drained (FIFO by group; so do whole-batch groups, which
  run alone as before).
- Every step advances every live row. A step that raises is bisected over the set's requests
  (`stages/isolation.py`): halves step on their own from the same inputs (a step that raises
  commits nothing), so only the culprit fails and leaves; its peers go on. A join that raises
  is bisected the same way (its `execute` faults fire there).
- An aborted request's rows leave at the next step boundary; its peers are untouched.
- The requests that end at a step leave at once, their rest (the decode) one job for the
  finisher thread, which sends their results; a group none of whose requests is left leaves
  the critical path (`Denoised`) with that job, and its `BatchDone` follows its last results.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from vllm_omni_like.outputs import StageOutput
from vllm_omni_like.stages.base import Deferred, RowStepper, Stage, StageControl
from vllm_omni_like.stages.isolation import bisect_isolated
from vllm_omni_like.wire import ExecuteBatch, StageRequest


@dataclass
class Group:
    """One ExecuteBatch's requests in the set."""

    batch_id: int
    ids: list[str]
    started: float
    left: set[str] = field(default_factory=set)  # still to leave


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


class RunningSet:
    def __init__(
        self,
        stage: Stage,
        control: StageControl,
        deliver: Callable[[int, StageOutput], None],
        hand_over: HandOver,
        validate: Callable[[ExecuteBatch], list[StageRequest]],
    ) -> None:
        self.stage = stage
        self.control = control
        self.deliver = deliver  # (batch id, output): a culprit's error, out at once
        self.hand_over = hand_over
        self.validate = validate  # the group's valid requests (the others answered)
        self.stepper: RowStepper | None = None
        self.groups: dict[int, Group] = {}  # in the set, oldest first
        self.group_of: dict[str, int] = {}  # request id -> its group's batch id
        self.waiting: deque[ExecuteBatch] = deque()  # groups that cannot join yet, in order

    @property
    def running(self) -> bool:
        return self.stepper is not None and bool(self.groups)

    @property
    def batch_ids(self) -> list[int]:
        return list(self.groups)

    def takes(self, batch: ExecuteBatch) -> bool:
        """Whether `batch` goes to the set (to join it, or to wait for it to drain); the worker
        runs the others whole, as before."""
        if self.running:
            return True
        return bool(batch.requests) and batch.requests[0].mode in self.stage.stepped_modes()

    def add(self, batch: ExecuteBatch) -> None:
        """Join now if the set takes it, else wait for the set to drain."""
        if self.running and not self._joins(batch):
            self.waiting.append(batch)
            return
        self._join(batch)

    def _joins(self, batch: ExecuteBatch) -> bool:
        assert self.stepper is not None
        same_kind = batch.requests[0].mode in self.stage.stepped_modes()
        return same_kind and all(self.stepper.accepts(r) for r in batch.requests)

    def _join(self, batch: ExecuteBatch) -> None:
        if not self.running:
            self.stepper = self.stage.stepper(batch.requests[0].mode)
            self.control.max_model_batch = 0
        assert self.stepper is not None
        stepper = self.stepper
        group = Group(batch.batch_id, [r.request_id for r in batch.requests], time.monotonic())
        self.groups[batch.batch_id] = group
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
        self._settle(None)

    def step(self) -> None:
        """One step of the set, then whatever ended leaves."""
        assert self.stepper is not None
        stepper = self.stepper

        def step(live: list[StageRequest]) -> list[StageOutput]:
            stepper.step(self.control, {r.request_id for r in live})
            return []

        with self._early():
            bisect_isolated(self.stage.name, stepper.requests, self.control, step, self._culprit)
        self._settle(stepper.leave(self.control))

    @contextlib.contextmanager
    def _early(self) -> Iterator[None]:
        """A row's output that the stage delivers before the row leaves (an LLM row that failed
        at its join) goes out at once, to its group."""
        self.control.report = lambda out: self.deliver(self.group_of[out.request_id], out)
        try:
            yield
        finally:
            self.control.report = None

    def next_waiting(self) -> ExecuteBatch | None:
        """The first group that waited, once the set has drained."""
        if self.running or not self.waiting:
            return None
        return self.waiting.popleft()

    def _culprit(self, out: StageOutput) -> None:
        """A request whose join or step raised alone: its error goes out, it leaves the set."""
        assert self.stepper is not None
        self.stepper.drop({out.request_id})
        self.deliver(self.group_of[out.request_id], out)

    def _settle(self, part: Deferred | None) -> None:
        """Hand over what left: the requests of `part` (ended at this step) and the groups
        none of whose requests is in the set any more, oldest first."""
        assert self.stepper is not None
        owners = (
            {}
            if part is None
            else {r.request_id: self.group_of[r.request_id] for r in part.requests}
        )
        inside = {r.request_id for r in self.stepper.requests}
        ended = []
        for batch_id in list(self.groups):
            group = self.groups[batch_id]
            group.left &= inside
            if not group.left:
                del self.groups[batch_id]
                for rid in group.ids:
                    self.group_of.pop(rid, None)
                ended.append(group)
        if part is not None or ended:
            self.hand_over(part, ended, owners)
