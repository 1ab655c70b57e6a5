"""One replica of a stage as the orchestrator sees it: its executor, its restarts, and the
batches it has in flight, bounded by credits.

A dispatch spends one of the replica's credits; the message that frees its critical path
(`Denoised`: the batch's denoising is done, its decode runs on the worker's finisher thread)
returns it; the batch's end (`BatchDone`) removes the batch, returning the credit if it had not
come back. With one credit (the default) a replica holds one batch on its critical path and one
being finished beside it; with `--replica-queue N` it also holds N batches queued at the worker,
which routing then spreads by the work each replica holds (engine/routing.py). The batch at the
head of the critical path is the one running: the stall bound looks at it, and at the oldest
batch being finished. A replica whose batch is past its bound is killed and is not live from
that moment (`stall`): it takes no work, and `/health` does not call it ready.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_omni_like.engine.request_state import RequestState
from vllm_omni_like.engine.stall import StepClock
from vllm_omni_like.errors import EngineDeadError
from vllm_omni_like.executor import Executor
from vllm_omni_like.executor.join_policy import GroupLoad, JoinPolicy
from vllm_omni_like.wire import OffloadReport, Progress, StartReport


@dataclass
class InFlight:
    batch_id: int
    requests: list[RequestState]
    dispatched: float
    units: float = 0.0  # work of one of its steps (cost.py)
    steps: int = 1  # its steps, as expected at dispatch and then as reported
    steps_done: int = 0
    started: float | None = None  # when it reached the head of the critical path
    denoised: float | None = None  # when it left the critical path (its credit came back)
    joined: bool = False  # it joined the replica's running set (it spent no credit)
    key: tuple[object, ...] = ()  # its shape group (StageRequest.batch_key)
    whole: bool = False  # its mode does not step rows: it runs alone (join_policy.py)
    # its requests whose rows have all ended in the running set (their decode may still wait
    # for its group): their rows and work are free for others to join
    ended: set[str] = field(default_factory=set)

    @property
    def units_left(self) -> float:
        return self.units * max(0, self.steps - self.steps_done)

    @property
    def rows(self) -> int:
        """Its requests still stepping in the running set."""
        return len(self.requests) - len(self.ended)

    @property
    def step_units(self) -> float:
        """The work of one step of its requests still stepping."""
        return self.load.step_units

    @property
    def load(self) -> GroupLoad:
        """It as the running-set policy sees it."""
        return GroupLoad(self.key, self.whole, len(self.requests), self.rows, self.units)


def _ended(rows: dict[str, tuple[int, int]], request_id: str) -> bool:
    at, of = rows.get(request_id, (0, 1))
    return at >= of


@dataclass(frozen=True)
class Stall:
    """Why the engine killed a replica: the batch that stalled and the bound it passed."""

    batch_id: int
    request_ids: frozenset[str]  # that batch's requests: the ones its death is charged to
    reason: str  # "no progress for 3.1s (bound 3.0s: stall timeout)"


@dataclass
class Replica:
    index: int
    clock: StepClock  # its measured step speed: the running batch's stall bound
    executor: Executor | None = None
    inflight: dict[int, InFlight] = field(default_factory=dict)  # by batch id, oldest first
    max_credits: int = 1  # batches on its critical path at once (running and queued)
    credits: int = 1
    restarts: int = 0
    restarting: bool = False
    last_dispatch: float = 0.0
    stall: Stall | None = None  # set when the engine kills it for a stall, until its death
    started_at: float = 0.0
    backoff: int = 0  # index into RESTART_BACKOFF_S; back to 0 after a stable run
    no_room_since: float = 0.0  # restarts have lacked room on the host since then (0: they did not)
    restart_error: str | None = None  # why the last restart failed (until one succeeds)
    device: str = "auto"  # where its workers run, as the host names it
    gpu_memory: int = 0  # bytes its worker's CUDA allocator held when it last said
    start: StartReport | None = None  # what its last start took and found (its worker said)
    offload: OffloadReport | None = None  # its idle-expert offload when its worker last said
    died_at: float = 0.0  # when its last death was seen, until its restart is ready (0: none)
    restart_seconds: float | None = None  # its last restart: from the death to ready again
    # groups the engine counted in the running set that the worker held back (a bug: see held)
    misjudged: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.credits = self.max_credits

    @property
    def workers(self) -> Executor:
        """The executor of a live replica (one being restarted has none)."""
        if self.executor is None:
            raise EngineDeadError(f"replica {self.index} has no workers now")
        return self.executor

    @property
    def live(self) -> bool:
        alive = self.executor is not None and self.executor.alive
        return alive and not self.restarting and self.stall is None

    @property
    def can_take(self) -> bool:
        """Live, with a credit, and room for another batch in flight (one may be finishing)."""
        return self.live and self.credits > 0 and len(self.inflight) <= self.max_credits

    @property
    def critical(self) -> InFlight | None:
        """The batch running on its critical path (dispatched, not yet denoised), if any."""
        return next((f for f in self.inflight.values() if f.denoised is None), None)

    @property
    def running(self) -> list[RequestState]:
        return [s for f in self.inflight.values() for s in f.requests]

    @property
    def holds_suspect(self) -> bool:
        """It runs a cohort of suspects (deaths.py): nothing runs beside it."""
        return any(s.cohort is not None for f in self.inflight.values() for s in f.requests)

    def attach(self, executor: Executor, now: float) -> None:
        """Its (new) executor, loaded and running."""
        self.executor, self.started_at, self.gpu_memory = executor, now, executor.gpu_memory
        self.start, self.offload = executor.start_report, executor.offload
        if self.died_at:  # a restart: back to ready this long after the death
            self.restart_seconds, self.died_at = now - self.died_at, 0.0

    @property
    def stepping(self) -> list[InFlight]:
        """The groups its running set steps now (started, still on the critical path)."""
        return [f for f in self.inflight.values() if f.denoised is None and f.started is not None]

    @property
    def set_units(self) -> float:
        """The work of one step of its running set (cost.py units): its rows still stepping."""
        return sum(f.step_units for f in self.stepping)

    def joinable(self, key: tuple[object, ...], units: Sequence[float], policy: JoinPolicy) -> int:
        """How many of the leading queued requests of shape group `key` (`units`: each one's
        work a step, in order) may join its running set now (0: none), as `policy` says. Ahead
        of them it counts every group on its critical path, those sent ahead that the worker
        has not yet said it steps included (the worker may have let them in): so the worker,
        which sees no more than that, always has room for them (join_policy.py)."""
        if not (self.live and self.stepping) or self.holds_suspect:
            return 0
        ahead = [f.load for f in self.inflight.values() if f.denoised is None]
        return policy.room(ahead, key, units)

    def outstanding(self) -> tuple[int, float]:
        """Requests and units of work on its critical path (running and queued)."""
        ahead = [f for f in self.inflight.values() if f.denoised is None]
        return sum(len(f.requests) for f in ahead), sum(f.units_left for f in ahead)

    def holds(self, state: RequestState) -> bool:
        return any(state in f.requests for f in self.inflight.values())

    def dispatched(self, batch: InFlight) -> None:
        self.inflight[batch.batch_id] = batch
        self.last_dispatch = batch.dispatched
        if batch.joined:  # it steps with the set from the next step: its work joins the clock's
            batch.started = batch.dispatched
            self.clock.units = self.set_units
            return
        self.credits -= 1
        self._start_next(batch.dispatched)

    def undispatched(self, batch_id: int) -> None:
        """The dispatch did not reach the worker (it died just then)."""
        batch = self.inflight.pop(batch_id, None)
        if batch is not None and not batch.joined:
            self.credits += 1

    def progress(self, report: Progress, now: float) -> None:
        """A step of its running batch (or set: the report's groups) was reported: each
        group's steps (its requests' own where they differ), and the clock. A group sent ahead
        of the set that the worker let in (to a lane of its own or another's) starts now: its
        work is the set's from here."""
        step, total, rows = report.step, report.total, report.progress
        stepped = False
        for batch_id in [report.batch_id, *report.joined]:
            batch = self.inflight.get(batch_id)
            if batch is None:
                continue
            if batch.started is None and not batch.whole:
                batch.started = now  # sent ahead (`--replica-queue`): the worker let it in
                self.clock.units = self.set_units
            own = (
                [rows[s.request_id] for s in batch.requests if s.request_id in rows] if rows else []
            )
            batch.steps_done, batch.steps = max(own) if own else (step, total)
            ended = {s.request_id for s in batch.requests if rows and _ended(rows, s.request_id)}
            if ended - batch.ended:  # their rows are out of the set: the step's work shrinks
                batch.ended |= ended
                self.clock.units = self.set_units
            stepped = stepped or (batch.denoised is None and batch.started is not None)
        if stepped:
            self.clock.step(now)

    def denoised(self, batch_id: int, now: float) -> InFlight | None:
        batch = self.inflight.get(batch_id)
        if batch is None or batch.denoised is not None:
            return None
        batch.denoised = now
        self._left_set(batch)
        self._start_next(now)
        return batch

    def done(self, batch_id: int, now: float) -> InFlight | None:
        batch = self.inflight.pop(batch_id, None)
        if batch is not None and batch.denoised is None:
            self._left_set(batch)
            self._start_next(now)
        return batch

    def _left_set(self, batch: InFlight) -> None:
        """`batch` left the critical path. The credit its dispatch spent is the running set's:
        it comes back when the set drains, a group that joined holding it until then. The
        clock keeps the last step's work once the set has drained (its expected step)."""
        if self.stepping:
            self.clock.units = self.set_units
        if batch.joined:
            return
        heir = next((f for f in self.stepping if f.joined), None)
        if heir is not None:
            heir.joined = False
        else:
            self.credits += 1

    def lost(self) -> None:
        """Its executor died: nothing is in flight any more."""
        self.died_at = self.died_at or time.monotonic()  # (a failed restart: the first death)
        self.inflight.clear()
        self.credits = self.max_credits

    def held(self, batch_id: int) -> bool:
        """The worker holds this group back (sent ahead; its set has no room for it yet): it
        starts when a step report names it. False if the engine had counted it in the set:
        the policy's two views disagreed (a bug): it is not counted from now."""
        batch = self.inflight.get(batch_id)
        if batch is None or batch.started is None:
            return True
        self.misjudged.append(batch_id)
        batch.started = None
        self.clock.units = self.set_units
        return False

    def _start_next(self, now: float) -> None:
        """The worker runs its batches in order: the next one starts when the one before leaves
        the critical path. A group of a running set's mode with others still on it may wait at
        the worker for room (join_policy.py): it starts when a step report names it."""
        batch = self.critical
        if batch is None or batch.started is not None:
            return
        if batch.whole or all(f is batch or f.denoised is not None for f in self.inflight.values()):
            batch.started = now
            self.clock.begin(self.set_units, now)

    def stalled_batch(
        self, now: float, stall_timeout: float, compile_timeout: float, peer_rate: float | None
    ) -> Stall | None:
        """The batch that passed its bound, if one did: the oldest one being finished (its
        decode, bound by `stall_timeout`, or `compile_timeout` while it compiles), else the
        one running (its step clock's bound; `peer_rate`: a peer's measured speed)."""
        oldest = next(iter(self.inflight.values()))
        if oldest.denoised is not None:
            bound, why = stall_timeout, "decode"
            if self.clock.compiling:
                bound, why = compile_timeout, "decode, compiling"
            if now - oldest.denoised > bound:
                return _stall([oldest], now - oldest.denoised, bound, why)
        running = self.critical
        if running is None:
            return None
        quiet = now - self.clock.last_step
        bound, why = self.clock.bound(peer_rate)
        if quiet > bound:  # a running set's step is all its groups': each is charged
            return _stall(
                [running, *(f for f in self.stepping if f is not running)], quiet, bound, why
            )
        return None


def _stall(batches: list[InFlight], quiet: float, bound: float, why: str) -> Stall:
    """The stall of the first of `batches`, charged to the requests of all of them."""
    ids = frozenset(s.request_id for f in batches for s in f.requests)
    reason = f"no progress for {quiet:.1f}s (bound {bound:.1f}s: {why})"
    return Stall(batches[0].batch_id, ids, reason)
