"""The orchestrator thread: routes each request stage by stage; owns errors, retries, aborts."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from vllm_omni_like import wire
from vllm_omni_like.config import EngineConfig
from vllm_omni_like.engine import deaths, snapshot
from vllm_omni_like.engine.admission import Admission
from vllm_omni_like.engine.events import (
    Abort,
    CutOff,
    FromReplica,
    InboxEvent,
    ReplicaRestarted,
    ReplicaRestartFailed,
    StopOrchestrator,
    Submit,
)
from vllm_omni_like.engine.ledger import Ledger, Unstored
from vllm_omni_like.engine.replica_start import in_parallel
from vllm_omni_like.engine.request_state import BatchReport, EngineStats, RequestState
from vllm_omni_like.engine.snapshot import EngineSnapshot
from vllm_omni_like.engine.stage_pool import ExecutorFactory, StagePool
from vllm_omni_like.errors import (
    ABORT_KINDS,
    AbortedError,
    EngineDeadError,
    ErrorInfo,
    ErrorKind,
    NotFoundError,
    OmniError,
    RequestTimeoutError,
    ShuttingDownError,
    StorageError,
    UnavailableError,
)
from vllm_omni_like.executor import MultiprocExecutor
from vllm_omni_like.inputs import OmniRequest
from vllm_omni_like.outputs import OmniRequestOutput, RequestEvent, RequestProgress, StageOutput
from vllm_omni_like.pipelines.base import Pipeline

logger = logging.getLogger(__name__)

TICK_S = 0.02
EARLY_ABORT_TTL_S = 120.0
ENDED_MEMORY = 16384  # ids of ended requests remembered, to tell late aborts from early ones
STORE_REPORT_S = 600.0  # a stored output not reported written by then is counted an error
RESTART_RETRY_AFTER_S = 2.0


def stages_run(request: OmniRequest, stages: int) -> int:
    """How many of its pipeline's `stages` a request runs (`last_stage`: a chat stops early)."""
    return stages if request.last_stage is None else min(request.last_stage + 1, stages)


class Orchestrator:
    def __init__(
        self, config: EngineConfig, executor_factory: ExecutorFactory = MultiprocExecutor
    ) -> None:
        self.config = config
        self.inbox: queue.Queue[InboxEvent] = queue.Queue()
        self.pipelines = {p.name: Pipeline(p) for p in config.pipelines}
        self.pools = {
            p.name: [
                StagePool(
                    p.name, i, s, self.inbox, config.faults, config.max_restarts, executor_factory
                )
                for i, s in enumerate(p.stages)
            ]
            for p in config.pipelines
        }
        self.requests: dict[str, RequestState] = {}
        self.deaths = deaths.DeathBook()  # charged deaths a conviction may refund
        self.early_aborts: dict[str, float] = {}
        self.stats = EngineStats()
        # request id -> final status of the last ENDED_MEMORY requests; a late abort for one of
        # them (a client that left while its final output was on the way) is a no-op, not an
        # "abort before submit" to remember
        self.recent_final: OrderedDict[str, str] = OrderedDict()
        self.admission = Admission(config.max_queue_size, config.max_queue_seconds)
        self._batch_ids = itertools.count(1)
        self.ledger = Ledger()  # the ids in the engine; successes whose store is not reported
        self._dead: ErrorInfo | None = None
        # all that other threads read of the pools and of the engine's death (published by
        # the orchestrator thread each tick)
        self.snapshot: EngineSnapshot = snapshot.take(self._all_pools(), None)
        self._thread: threading.Thread | None = None
        self._stopped = False

    # ---- any thread --------------------------------------------------------------------------
    def start(self) -> None:
        pools = self._all_pools()
        errors = in_parallel(StagePool.start, pools)
        if errors:
            for pool in pools:
                pool.shutdown()
            raise errors[0]
        self._publish()
        self._thread = threading.Thread(target=self._run, name="orchestrator", daemon=True)
        self._thread.start()

    def _all_pools(self) -> list[StagePool]:
        return [pool for pools in self.pools.values() for pool in pools]

    def _publish(self) -> None:
        self.snapshot = snapshot.take(self._all_pools(), self._dead)

    @property
    def errored(self) -> bool:
        dead = self.snapshot.dead is not None
        return dead or (self._thread is not None and not self._thread.is_alive())

    @property
    def dead_error(self) -> EngineDeadError:
        info = self.snapshot.dead
        return EngineDeadError(info.message if info else "the engine is not running")

    def submit(self, request: OmniRequest, emit: Callable[[RequestEvent], None]) -> None:
        """Admit a request (or raise at once); its events and final output go to `emit`."""
        if self.errored or self._stopped:
            raise self.dead_error
        pipeline = self.pipelines.get(request.pipeline)
        if pipeline is None:
            raise NotFoundError(
                f"model {request.pipeline!r} is not served here; served: "
                f"{', '.join(self.pipelines)}",
                code="model_not_found",
                param="model",
            )
        stages = self.snapshot.of(pipeline.name)
        runs = stages_run(request, len(stages))
        for stage in stages[:runs]:  # (a stage it will not reach may be restarting)
            if stage.state == "restarting":  # nothing can run it now: say when to come back
                raise UnavailableError(
                    "no live replica; a restart is under way",
                    stage=stage.name,
                    code="restarting",
                    retry_after=RESTART_RETRY_AFTER_S,
                )
        units = snapshot.work_units(request.params, stages)
        units = tuple(u if i < runs else 0.0 for i, u in enumerate(units))
        self.ledger.claim(request.request_id)
        try:
            self.admission.admit(pipeline.name, units, stages)
        except BaseException:
            self.ledger.release(request.request_id)
            raise
        self.stats.admitted()
        timeout = request.timeout or self.config.request_timeout
        state = RequestState(request, emit, deadline=time.monotonic() + timeout, units=units)
        self.inbox.put(Submit(state))

    def stored(self, request_id: str, error: ErrorInfo | None = None) -> None:
        """The caller that stores a request's output (`OmniRequest.stores_output`) wrote it, or
        could not (`error`): the request's final status is recorded now."""
        unstored = self.ledger.stored(request_id)
        if unstored is None:
            return  # not a success awaiting its store, or reported already
        status = "success" if error is None else error.final_status
        self.stats.finished(unstored.pipeline, status, time.monotonic() - unstored.created)

    def abort(self, request_id: str, kind: ErrorKind = ErrorKind.ABORTED) -> None:
        if kind not in ABORT_KINDS:
            raise ValueError(f"an abort ends a request as one of {ABORT_KINDS}, not {kind}")
        self.inbox.put(Abort(request_id, kind))

    def cut_off(self, message: str) -> None:
        """End every request in the engine now with a 503 `shutting_down` (the drain is over)."""
        self.inbox.put(CutOff(message))

    def health(self) -> list[dict[str, object]]:
        return [stage.health() for stage in self.snapshot.stages]

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.inbox.put(StopOrchestrator())
        if self._thread is not None:
            self._thread.join(30)
        every = [pool for pools in self.pools.values() for pool in pools]
        for exc in in_parallel(lambda pool: pool.shutdown(), every):  # their grace periods overlap
            logger.error("a stage failed to shut down: %r", exc)
        for state in list(self.requests.values()):
            self._finish(state, EngineDeadError("the engine shut down"))

    # ---- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                # 1) wait for a message, or the next tick
                try:
                    msg: InboxEvent | None = self.inbox.get(timeout=TICK_S)
                except queue.Empty:
                    msg = None
                # 2) handle it and whatever else is queued
                while msg is not None:
                    if isinstance(msg, StopOrchestrator):
                        return
                    self._handle(msg)
                    try:
                        msg = self.inbox.get_nowait()
                    except queue.Empty:
                        msg = None
                # 3) deadlines, stalls
                now = time.monotonic()
                self._check_deadlines(now)
                for pools in self.pools.values():
                    for pool in pools:
                        pool.check_stalls(now)
                # 4) hand queued work to idle replicas; 5) tell the other threads
                self._dispatch()
                self._publish()
        except BaseException as exc:
            logger.exception("orchestrator thread died")
            self._die(EngineDeadError(f"the orchestrator thread died: {type(exc).__name__}: {exc}"))

    def _handle(self, msg: InboxEvent) -> None:
        match msg:
            case Submit(state=state):
                self._on_submit(state)
            case Abort(request_id=rid, kind=kind):
                aborted = self.requests.get(rid)
                if aborted is None and rid not in self.recent_final:
                    self.early_aborts[rid] = time.monotonic()  # remembered, not lost
                elif aborted is not None:
                    self._abort(aborted, kind)
            case CutOff(message=message):
                for state in list(self.requests.values()):
                    self._abort(state, ErrorKind.SHUTTING_DOWN, message)
            case FromReplica(pipeline=pipe, stage=stage, replica=replica, msg=inner):
                self._on_replica_message(pipe, stage, replica, inner)
            case ReplicaRestarted(pipeline=pipe, stage=stage, replica=replica, executor=ex):
                self.pools[pipe][stage].on_restarted(replica, ex)
                self.stats.restarted()
            case ReplicaRestartFailed(pipeline=pipe, stage=stage, replica=replica, error=err):
                logger.error("restart of %s replica %d failed: %s", pipe, replica, err.message)
                pool = self.pools[pipe][stage]
                pool.on_restart_failed(replica, err.message, msg.lacked_room)
                if pool.state == "dead":
                    self._die(
                        EngineDeadError(
                            f"no live replica and no restart left; last "
                            f"restart failed: {err.message}",
                            stage=pool.name,
                        )
                    )

    def _on_submit(self, state: RequestState) -> None:
        rid = state.request_id
        if self.early_aborts.pop(rid, None) is not None:
            self._finish(state, AbortedError("the request was aborted"))
            return
        if self._dead is not None:
            self._finish(state, self.dead_error)
            return
        self.requests[rid] = state
        self._enter_stage(state, 0, None)

    def _last_stage(self, state: RequestState) -> int:
        """The index of the last stage this request runs."""
        return stages_run(state.request, len(self.pools[state.request.pipeline])) - 1

    def _enter_stage(self, state: RequestState, index: int, previous: StageOutput | None) -> None:
        pipeline = self.pipelines[state.request.pipeline]
        state.stage_index, state.replica = index, None
        state.cohort, state.chain = None, set()  # it ran its last stage clean
        state.stage_request = pipeline.stage_request(state.request, index, previous)
        state.pool = self.pools[pipeline.name][index]
        state.pool.enqueue(state)

    def _on_replica_message(self, pipe: str, stage: int, replica: int, msg: object) -> None:
        pool = self.pools[pipe][stage]
        match msg:
            case wire.RequestResult(output=out):
                state = self.requests.get(out.request_id)
                if state is None or state.stage_index != stage or state.replica != replica:
                    return  # finished or aborted already
                if out.error is not None:
                    self._finish(state, out.error)
                    return
                state.outputs[pool.name] = out
                self.stats.stage_done(pool.name, time.monotonic() - state.stage_started)
                if stage < self._last_stage(state):
                    self._enter_stage(state, stage + 1, out)
                else:
                    self._finish(state, None)
            case wire.BatchDone(batch_id=bid, batch_size=size, steps_run=steps) as done:
                pool.batch_done(replica, bid, done.gpu_memory, done.offload)
                report = (pool.name, size, steps, done.steps_after_abort, done.model_batch_dim)
                self.stats.batch_done(BatchReport(*report, done.phases))
            case wire.Denoised(batch_id=bid):
                pool.denoised(replica, bid)
            case wire.Held(batch_id=bid):
                pool.held(replica, bid)
            case wire.Compiling(active=active, rank=rank):
                pool.on_compiling(replica, rank, active, time.monotonic())
                if active:
                    self.stats.compiled()
            case wire.Progress(request_ids=ids, step=step, total=total) as report:
                pool.on_progress(replica, report, time.monotonic())
                own = report.progress or {}
                for rid in ids:
                    state = self.requests.get(rid)
                    if state is not None:
                        preview = report.previews.get(rid)
                        state.partials_sent += preview is not None
                        at, of = own.get(rid, (step, total))
                        state.emit(RequestProgress(rid, pool.name, at, of, preview))
            case wire.ReplicaDied() as event:
                self._on_replica_death(pool, replica, event)

    def _on_replica_death(self, pool: StagePool, replica: int, event: wire.ReplicaDied) -> None:
        self.stats.worker_died()
        stall = pool.stall_of(replica)  # read before on_death forgets it
        lost = deaths.lost_requests(self.requests, pool, replica, event)
        guilty = deaths.charged(lost, stall)
        pool.on_death(replica, charged=self.deaths.record(pool, replica, guilty))
        culprit = deaths.convicted(guilty)
        if culprit is not None:
            self.deaths.absolve(culprit, [p for pools in self.pools.values() for p in pools])
        self.deaths.settle(
            lost, guilty, pool, event, stall, self.config.max_request_retries, self._finish
        )
        if pool.state == "dead":
            self._die(
                EngineDeadError(
                    f"worker {event.exit_desc}; no live replica and no restart left",
                    stage=pool.name,
                )
            )

    def _die(self, error: EngineDeadError) -> None:
        """A stage is dead: the engine is dead for good; every waiting request ends now."""
        if self._dead is None:
            self._dead = error.info
            self._publish()
            logger.error("engine is dead: %s", error.message)
        for state in list(self.requests.values()):
            self._finish(state, EngineDeadError(self._dead.message))

    def _abort(self, state: RequestState, kind: ErrorKind, message: str = "") -> None:
        pool = self.pools[state.request.pipeline][state.stage_index]
        if not pool.remove(state):
            pool.abort_running(state)
        match kind:
            case ErrorKind.SHUTTING_DOWN:
                self._finish(state, ShuttingDownError(message))
            case ErrorKind.TIMEOUT:
                timeout = state.deadline - state.created
                error = f"the request's deadline of {timeout:.1f}s passed"
                self._finish(state, RequestTimeoutError(error, stage=pool.name))
            case _:
                self._finish(state, AbortedError("the request was aborted", stage=pool.name))

    def _check_deadlines(self, now: float) -> None:
        for state in [s for s in self.requests.values() if s.deadline <= now]:
            self._abort(state, ErrorKind.TIMEOUT)
        stale = [rid for rid, t in self.early_aborts.items() if now - t > EARLY_ABORT_TTL_S]
        for rid in stale:
            del self.early_aborts[rid]
        for rid in self.ledger.overdue(now, STORE_REPORT_S):
            logger.error("request %s: its output's store was never reported; an error", rid)
            self.stored(rid, StorageError("the output's store was never reported").info)

    def _dispatch(self) -> None:
        for pools in self.pools.values():
            for i, pool in enumerate(pools):
                downstream = pools[i + 1] if i + 1 < len(pools) else None
                if downstream is not None and len(downstream.waiting) >= downstream.capacity:
                    continue  # back-pressure: hold work here rather than refuse it later
                for batch in pool.dispatch(lambda: next(self._batch_ids)):
                    self.stats.dispatched(pool.name, len(batch))

    def _finish(self, state: RequestState, error: OmniError | ErrorInfo | None) -> None:
        """End a request exactly once: its final output, its status, and no state left."""
        if state.finished:
            return
        state.finished = True
        rid = state.request_id
        if self.requests.get(rid) is state:
            del self.requests[rid]
        pools = self.pools[state.request.pipeline]
        pool = pools[state.stage_index]
        pool.remove(state)
        self.admission.release(state.request.pipeline, state.units)
        info = error.info if isinstance(error, OmniError) else error
        last = state.outputs.get(pools[self._last_stage(state)].name) if info is None else None
        output = OmniRequestOutput(
            request_id=rid,
            stage_id=pool.name,
            output=last,
            error=info,
            revised_prompt=Pipeline.revised_prompt(state.outputs),
            stage_outputs=state.outputs,
        )
        status = info.final_status if info is not None else "success"
        self.recent_final[rid] = status
        self.recent_final.move_to_end(rid)
        if len(self.recent_final) > ENDED_MEMORY:
            self.recent_final.popitem(last=False)
        now, pipeline = time.monotonic(), state.request.pipeline
        if status == "success" and state.request.stores_output:  # recorded once it is stored
            self.ledger.ended(rid, Unstored(pipeline, state.created, now))
        else:
            self.ledger.ended(rid, None)
            self.stats.finished(pipeline, status, now - state.created)
        state.emit(output)
