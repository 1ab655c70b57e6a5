"""The replicas of one stage: a waiting queue, dynamic batching, deaths and restarts.

Only the orchestrator thread calls into a pool, except the restart threads, which report back
through the orchestrator's inbox.
"""

from __future__ import annotations

import itertools
import logging
import queue
import time
from collections import deque
from collections.abc import Callable

from vllm_omni_like import cost
from vllm_omni_like.config import FaultRule, StageConfig
from vllm_omni_like.engine import routing
from vllm_omni_like.engine.batching import make_policy, take_compatible
from vllm_omni_like.engine.events import (
    FromReplica,
    InboxEvent,
    ReplicaRestarted,
    ReplicaRestartFailed,
)
from vllm_omni_like.engine.replica import InFlight, Replica, Stall
from vllm_omni_like.engine.replica_start import ReplicaStarter, in_parallel, lacks_room
from vllm_omni_like.engine.request_state import RequestState
from vllm_omni_like.engine.stall import StepClock
from vllm_omni_like.errors import EngineDeadError, classify
from vllm_omni_like.executor import Executor, MultiprocExecutor
from vllm_omni_like.executor.join_policy import JoinPolicy
from vllm_omni_like.executor.placement import replica_label
from vllm_omni_like.models.limits import describe_stage
from vllm_omni_like.wire import ExecuteBatch, FromWorker, Mode, OffloadReport, Progress

logger = logging.getLogger(__name__)

RESTART_BACKOFF_S = (0.2, 1.0, 2.0, 5.0)
NO_ROOM_RETRY_S = 1.0  # a restart that lacked descriptors or memory: tried again this often
STABLE_RUN_S = 30.0  # a replica that lived this long starts its back-off from the beginning
ExecutorFactory = Callable[..., Executor]


class StagePool:
    def __init__(
        self,
        pipeline: str,
        index: int,
        config: StageConfig,
        inbox: queue.Queue[InboxEvent],
        faults: tuple[FaultRule, ...],
        max_restarts: int,
        executor_factory: ExecutorFactory = MultiprocExecutor,
    ) -> None:
        self.pipeline = pipeline
        self.index = index
        self.config = config
        self.name = config.name
        self.inbox = inbox
        self.faults = faults
        self.max_restarts = max_restarts
        self.factory = executor_factory
        self.replicas = [
            Replica(
                i,
                max_credits=1 + config.replica_queue,
                clock=StepClock(config.stall_timeout, config.compile_timeout, config.cold_timeout),
                device=replica_label(config, i),
            )
            for i in range(config.replicas)
        ]
        options = config.options
        # who may join a replica's running set, and how many (the workers ask it too)
        self.join = JoinPolicy.of(config)
        # the cost model's view of the stage: text stages count rows x tokens
        self.text = self.join.text
        steps = getattr(options, "max_new_tokens" if self.text else "default_steps", None)
        self.default_steps = steps or getattr(options, "steps", None) or cost.DEFAULT_STEPS
        self.family = describe_stage(config)  # which adapter its workers run (models/)
        # modes whose rows each carry their own steps, guidance, scheduler and seed
        loops = self.family["loops"] if self.family else {}
        self.own_loop = frozenset(mode for mode, loop in loops.items() if loop == "own")
        # the modes whose rows join a running set: what the workers said they step
        self.stepped: frozenset[Mode] = frozenset()
        self.precision: str | None = None  # what its model computes in, once a worker said
        self.waiting: deque[RequestState] = deque()
        self.policy = make_policy(config)
        self.started = False
        self.starter = ReplicaStarter(self.name, self._make_executor)
        self._stopping = self.starter.stopping

    # ---- lifecycle -----------------------------------------------------------------------------
    def _make_executor(self, index: int) -> Executor:
        def sink(msg: FromWorker) -> None:
            self.inbox.put(FromReplica(self.pipeline, self.index, index, msg))

        executor = self.factory(self.config, index, sink, self.faults)
        executor.add_failure_callback(sink)  # a ReplicaDied reaches the orchestrator the same way
        return executor

    def start(self) -> None:
        """Start every replica (in parallel); raise the first failure."""
        started, errors = self.starter.start_all([r.index for r in self.replicas])
        for index, executor in started.items():
            self.replicas[index].attach(executor, time.monotonic())
            self._learn(executor)
            self.starter.handed_over(executor)
        if errors:
            self.shutdown()
            raise errors[0]
        self.started = True

    def shutdown(self) -> None:
        """Every executor at once: each may give its workers a grace period to end a batch, and
        one after the other those would add up."""
        starting = self.starter.shutdown()  # a start under way, or done but not handed over
        executors = [r.executor for r in self.replicas if r.executor is not None] + starting
        for exc in in_parallel(lambda executor: executor.shutdown(), executors):
            logger.error("stage %s: an executor failed to shut down: %r", self.name, exc)

    # ---- state -----------------------------------------------------------------------------------
    @property
    def live_count(self) -> int:
        return sum(r.live for r in self.replicas)

    @property
    def state(self) -> str:
        if not self.started:
            return "starting"
        if self.live_count:
            return "ready"
        # a replica killed for a stall is restarted once its death is seen (within a tick)
        replacing = any(r.restarting or r.stall is not None for r in self.replicas)
        return "restarting" if replacing else "dead"

    @property
    def capacity(self) -> int:
        """How much may wait here before the stage before it holds back (back-pressure)."""
        return 2 * self.config.max_batch_size * len(self.replicas)

    # ---- queue and batching ------------------------------------------------------------------
    def enqueue(self, state: RequestState, front: bool = False) -> None:
        state.enqueued_at = time.monotonic()
        if front:
            self.waiting.appendleft(state)
        else:
            self.waiting.append(state)

    def _learn(self, executor: Executor) -> None:
        """What a started replica's workers step as a running set: those modes' rows batch by
        shape only (each row its own steps) and may join a set of their shape group."""
        self.stepped = frozenset(executor.stepped)
        self.own_loop = self.own_loop | self.stepped
        self.precision = executor.precision or self.precision

    def remove(self, state: RequestState) -> bool:
        # by identity, without deque.remove: its ValueError for a request that is not queued
        # (most of them, at their end) formats the request's repr, outputs and all
        for i, waiting in enumerate(self.waiting):
            if waiting is state:
                del self.waiting[i]
                return True
        return False

    def dispatch(self, next_batch_id: Callable[[], int]) -> list[list[RequestState]]:
        """Give the queued work to live replicas with a credit (those the batch policy does not
        hold back), each batch where routing says; no waiting."""
        sent: list[list[RequestState]] = []
        failed: set[int] = set()
        while self.waiting:
            now = time.monotonic()
            suspect = self.waiting[0].cohort is not None  # alone: on a replica with nothing else
            free = [
                r
                for r in self.replicas
                if r.can_take
                and r.index not in failed
                and not r.holds_suspect
                and not (suspect and r.inflight)
                and not self.policy.hold(r.index, self.waiting, now)
            ]
            if free:
                batch, self.waiting = take_compatible(
                    self.waiting, self.config.max_batch_size, self.own_loop
                )
                flight = self._in_flight(next_batch_id(), batch, now)
                replica = routing.choose(free, flight.units_left, self.config.routing)
                self.policy.took(replica.index)
            else:  # no replica is free: the head's rows may join a running set of their group
                joining = self._join(next_batch_id, now, failed)
                if joining is None:
                    break
                replica, flight = joining
                batch = flight.requests
            replica.dispatched(flight)
            for s in batch:
                s.replica, s.stage_started = replica.index, now
            try:
                request = ExecuteBatch(flight.batch_id, [s.staged for s in batch])
                replica.workers.execute(request)
            except EngineDeadError:  # it died just now; its ReplicaDied is on the way
                replica.undispatched(flight.batch_id)
                failed.add(replica.index)
                for s in reversed(batch):
                    s.replica = None
                    self.waiting.appendleft(s)
                continue
            sent.append(batch)
        return sent

    def _join(
        self, next_batch_id: Callable[[], int], now: float, failed: set[int]
    ) -> tuple[Replica, InFlight] | None:
        """The queue's head and the requests behind it that share its shape group, as a group
        that joins the running set of a busy replica, as many as the running-set policy lets in
        (executor/join_policy.py): one stepping that group (the one with most room) before one
        where it opens a lane; None if none may (FIFO: the head waits for room)."""
        head = self.waiting[0]
        if head.cohort is not None or head.staged.loop_mode not in self.stepped:
            return None
        key = head.staged.batch_key(self.own_loop)
        same = (
            s for s in self.waiting if s.cohort is None and s.staged.batch_key(self.own_loop) == key
        )
        units = [self.join.units(s.staged.params) for s in itertools.islice(same, self.join.budget)]
        rooms = [
            (r.joinable(key, units, self.join), r) for r in self.replicas if r.index not in failed
        ]
        room, replica = max(
            rooms,
            key=lambda pair: (pair[0] > 0, any(f.key == key for f in pair[1].stepping), pair[0]),
            default=(0, None),
        )
        if not room or replica is None:
            return None
        batch, self.waiting = take_compatible(self.waiting, room, self.own_loop)
        flight = self._in_flight(next_batch_id(), batch, now)
        flight.joined = True
        return replica, flight

    def _in_flight(self, batch_id: int, batch: list[RequestState], now: float) -> InFlight:
        """The batch as the cost model sees it: units per step, and its steps (its longest
        request's: rows of our own loop run their own step counts)."""
        params = [s.staged.params for s in batch]
        return InFlight(
            batch_id,
            batch,
            now,
            units=sum(cost.step_units(p, self.text) for p in params),
            steps=max(cost.steps_of(p, self.default_steps, self.text) for p in params),
            key=batch[0].staged.batch_key(self.own_loop),
            whole=batch[0].staged.loop_mode not in self.stepped,
        )

    def parallel_rate(self) -> float | None:
        """Seconds per unit of work of the live replicas side by side (None: none measured)."""
        return cost.parallel_rate(r.clock.speed.rate for r in self.replicas if r.live)

    def denoised(self, replica_index: int, batch_id: int) -> None:
        """The replica's batch left the critical path: the replica may take the next one now."""
        batch = self.replicas[replica_index].denoised(batch_id, time.monotonic())
        if batch is not None:
            self.policy.denoised(replica_index, len(batch.requests), len(self.waiting))

    def batch_done(
        self,
        replica_index: int,
        batch_id: int,
        gpu_memory: int = 0,
        offload: OffloadReport | None = None,
    ) -> None:
        replica = self.replicas[replica_index]
        replica.gpu_memory = gpu_memory or replica.gpu_memory
        replica.offload = offload or replica.offload
        now = time.monotonic()
        batch = replica.done(batch_id, now)
        if batch is None or replica.critical is not None:
            return  # not ours, or busy with the next batch already: nothing to wait for
        size = len(batch.requests)
        self.policy.batch_done(replica_index, size, batch.dispatched, now, len(self.waiting))

    def abort_running(self, state: RequestState) -> None:
        if state.replica is None:
            return
        replica = self.replicas[state.replica]
        if replica.executor is not None and replica.holds(state):
            replica.executor.abort([state.request_id])

    def held(self, replica_index: int, batch_id: int) -> None:
        """The replica's worker holds a group back until its running set has room."""
        if not self.replicas[replica_index].held(batch_id):  # the policy's two views disagree
            logger.error("stage %s: group %d held at the worker, yet counted", self.name, batch_id)

    def on_progress(self, replica_index: int, report: Progress, now: float) -> None:
        """A step of a batch (a running set: its groups) was reported: the replica's step
        clock calibrates on it."""
        self.replicas[replica_index].progress(report, now)

    def on_compiling(self, replica_index: int, rank: int, active: bool, now: float) -> None:
        """A rank of the replica began or ended a compilation (its own allowance)."""
        self.replicas[replica_index].clock.compile_state(rank, active, now)

    def stall_of(self, replica_index: int) -> Stall | None:
        """Why the engine killed this replica, if it did (read before its death is handled)."""
        return self.replicas[replica_index].stall

    # ---- failures -------------------------------------------------------------------------------
    def on_death(self, replica_index: int, charged: bool = True) -> None:
        """The replica's executor died: free it, schedule a restart if any is left.

        A replica that ran stably before it died gets its restart budget back; a death while a
        cohort of suspects ran (`charged=False`) is theirs, not the replica's.
        """
        replica = self.replicas[replica_index]
        replica.lost()
        self.policy.forget(replica.index)
        if time.monotonic() - replica.started_at > STABLE_RUN_S:
            replica.backoff = replica.restarts = 0
        if replica.executor is not None:
            replica.executor.shutdown()
        replica.executor, replica.stall = None, None
        replica.clock.restarted()
        if (replica.restarts < self.max_restarts or not charged) and not self._stopping.is_set():
            # a bisection's death (deaths.py) is bounded by it: the first back-off, not grown
            self._restart(replica, charged, None if charged else RESTART_BACKOFF_S[0])

    def refund(self, replica_index: int) -> None:
        """An earlier death of this replica turned out to be a poison request's doing."""
        replica = self.replicas[replica_index]
        replica.restarts = max(0, replica.restarts - 1)

    def _restart(self, replica: Replica, charged: bool = True, delay: float | None = None) -> None:
        replica.restarting = True
        if delay is None:
            delay = RESTART_BACKOFF_S[min(replica.backoff, len(RESTART_BACKOFF_S) - 1)]
            replica.backoff += 1
        replica.restarts += charged
        logger.warning(
            "stage %s: restarting replica %d in %.1fs (restart %d of %d%s)",
            self.name,
            replica.index,
            delay,
            replica.restarts,
            self.max_restarts,
            "" if charged else "; this try is not counted",
        )
        index = replica.index

        def started(executor: Executor) -> None:
            self.inbox.put(ReplicaRestarted(self.pipeline, self.index, index, executor))

        def failed(exc: BaseException) -> None:
            err = classify(exc, self.name)
            self.inbox.put(
                ReplicaRestartFailed(self.pipeline, self.index, index, err, lacks_room(exc))
            )

        self.starter.restart_later(index, delay, started, failed)

    def on_restarted(self, replica_index: int, executor: Executor) -> None:
        self.starter.handed_over(executor)
        replica = self.replicas[replica_index]
        replica.attach(executor, time.monotonic())
        self._learn(executor)
        replica.restarting, replica.no_room_since, replica.restart_error = False, 0, None
        if self._stopping.is_set():
            executor.shutdown()

    def on_restart_failed(self, replica_index: int, message: str, lacked_room: bool) -> None:
        """A restart that lacked room on the host (descriptors, memory) is tried again each
        second without spending the budget, for up to the stage's load timeout; any other
        failure spends one restart."""
        replica = self.replicas[replica_index]
        replica.restarting, replica.restart_error = False, message
        if self._stopping.is_set():
            return
        now = time.monotonic()
        if lacked_room:
            replica.no_room_since = replica.no_room_since or now
            if now - replica.no_room_since <= self.config.load_timeout:
                self._restart(replica, charged=False, delay=NO_ROOM_RETRY_S)
                return
        if replica.restarts < self.max_restarts:
            self._restart(replica)

    def check_stalls(self, now: float) -> None:
        """Kill a replica whose batch on the critical path reports no progress within its step
        clock's bound, or whose batch being finished (its decode) is not done `stall_timeout`
        after it left the critical path (the compile timeout while it compiles): a death
        follows, which charges only the batch that stalled."""
        for r in self.replicas:
            if r.executor is None or r.stall is not None or not r.inflight:
                continue
            config = self.config
            stalled = r.stalled_batch(
                now, config.stall_timeout, config.compile_timeout, self._peer_rate(r)
            )
            if stalled is not None:
                r.stall = stalled
                logger.error(
                    "stage %s replica %d: %s; killing it", self.name, r.index, stalled.reason
                )
                r.executor.kill(f"stalled: {stalled.reason}")

    def _peer_rate(self, replica: Replica) -> float | None:
        """The speed another replica of this stage measured on the same kind of device."""
        kind = replica.device.split(":")[0]
        for r in self.replicas:
            if r is not replica and r.device.split(":")[0] == kind and r.clock.speed.rate:
                return r.clock.speed.rate
        return None
