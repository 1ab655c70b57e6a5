"""Worker process main: load the stage once, then run batches until told to stop.

Threads: the main thread runs batches; the receiver applies aborts at once; the finisher runs
the deferred rest of a batch (a diffusion stage's VAE decode) while the main thread already
denoises the next one.
"""

from __future__ import annotations

import faulthandler
import functools
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from vllm_omni_like.config import FaultRule, StageConfig
from vllm_omni_like.errors import EngineDeadError, FatalStageError, InvalidRequestError, classify
from vllm_omni_like.executor import placement, process_life, transport
from vllm_omni_like.executor.finisher import Finisher
from vllm_omni_like.executor.join_policy import JoinPolicy
from vllm_omni_like.executor.placement import gpu_memory_in_use
from vllm_omni_like.executor.running_set import Group, Job, RunningSet
from vllm_omni_like.outputs import StageOutput
from vllm_omni_like.parallel.ranks import Ranks
from vllm_omni_like.stages.base import Deferred, Stage, StageControl, create_stage
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.stages.isolation import begin_isolated, finish_parts
from vllm_omni_like.wire import (
    AbortRequests,
    BatchDone,
    Compiling,
    Denoised,
    ExecuteBatch,
    FollowBatch,
    Held,
    Progress,
    RequestResult,
    Shutdown,
    StageRequest,
    WorkerLoadFailed,
    WorkerReady,
)

logger = logging.getLogger("vllm_omni_like.worker")

EXIT_FATAL = 3
T = TypeVar("T")


class _Worker:
    def __init__(
        self,
        channel: transport.Channel,
        config: StageConfig,
        ranks: Ranks,
        device: str,
        faults: tuple[FaultRule, ...],
    ) -> None:
        self.channel = channel
        self.config = config
        self.ranks = ranks
        self.rank = ranks.rank
        self.device = device
        # other ranks compute the same batch, or (CFG-parallel) serve rank 0's branch calls;
        # rank 0 answers
        self.reports = self.rank == 0
        self.inbox: queue.Queue[Any] = queue.Queue()
        self.batch_id = -1
        self.joined: list[int] = []  # the other groups of the running set that step with it
        self.sent: dict[int, set[str]] = {}  # per batch: requests whose output went out
        self.control = StageControl(FaultInjector(faults, config.name), self._progress)
        self.stage: Stage | None = None
        self.name = config.name
        # jobs whose rest (the decode) runs on the finisher thread, in order
        self.finisher: Finisher[Job] = Finisher(self._finish_or_exit)
        self.control.reclaim = self.finisher.wait_idle

    def send(self, msg: object) -> None:
        self.channel.send(msg)

    def report_compiles(self) -> None:
        """Tell the engine when torch.compile starts and ends compiling (on any thread: the
        decoder compiles on the finisher), so that only a step that compiles gets the compile
        timeout. Nested compiles are one: torch runs the callbacks at the outermost ends."""
        from torch._dynamo.callback import callback_handler  # only a compiled stage has torch

        # every rank: rank 0's step waits on a CFG-parallel rank 1's compile too
        callback_handler.register_start_callback(lambda *_: self.send(Compiling(True, self.rank)))
        callback_handler.register_end_callback(lambda *_: self.send(Compiling(False, self.rank)))

    def _progress(
        self,
        ids: list[str],
        step: int,
        total: int,
        previews: dict[str, Any],
        progress: dict[str, tuple[int, int]] | None = None,
    ) -> None:
        if self.reports:
            self.send(Progress(self.batch_id, ids, step, total, previews, progress, self.joined))

    # 1) load ------------------------------------------------------------------------------------
    def load(self) -> bool:
        started = time.monotonic()
        try:
            self.control.faults.fire_load()
            placement.limit_memory(self.device, self.config.gpu_memory_fraction)
            self.stage = create_stage(self.config, self.ranks)
            self.stage.load(self.device)
        except Exception as exc:
            info = EngineDeadError(f"failed to load: {classify(exc).message}").info
            self.send(WorkerLoadFailed(self.rank, info, traceback.format_exc()))
            return False
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        # request-level batching: the same messages, each group run whole (no mode steps)
        stepped = self.stage.stepped_modes() if self.config.batch_level == "step" else ()
        self.rows = RunningSet(
            self.stage,
            self.control,
            self._deliver,
            self._set_left,
            self._validate,
            stepped,
            JoinPolicy.of(self.config),
        )
        memory, precision = gpu_memory_in_use(), self.stage.precision()
        took = time.monotonic() - started
        start = placement.start_report(self.config.compile, took, self.stage.cuda_graphs())
        ready = WorkerReady(self.rank, os.getpid(), self.device, visible, memory, stepped)
        ready.precision, ready.start, ready.offload = precision, start, self.stage.offload()
        self.send(ready)
        return True

    # 2) receive: aborts apply at once, even while a batch runs ----------------------------------
    def receive_forever(self) -> None:
        while True:
            try:
                msg = self.channel.recv()
            except (EOFError, OSError):
                os._exit(0)  # the parent closed the pipe or died
            match msg:
                case AbortRequests(request_ids=ids):
                    self.control.abort(ids)
                case _:
                    self.inbox.put(msg)

    # 3) run batches -------------------------------------------------------------------------------
    def run_forever(self) -> None:
        """Every message that arrived (each group joins at this step boundary), then one step
        of the running set; with no set running, wait for the next message."""
        while True:
            msg = self._queued() if self.rows.running else self.inbox.get()
            while msg is not None:
                if not self._handle(msg):
                    return
                msg = self._queued()
            if self.rows.running:
                self._step_set()

    def _handle(self, msg: Any) -> bool:
        """False: stop (after the set's rows and the batch being finished are out)."""
        match msg:
            case ExecuteBatch() as batch:
                self._accept(batch)
            case FollowBatch(batch_id=batch_id):
                self._guard(self._serve, batch_id)
            case Shutdown():
                while self.rows.running:
                    self._step_set()
                self.finisher.wait_idle()
                return False
        return True

    def _queued(self) -> Any:
        try:
            return self.inbox.get_nowait()
        except queue.Empty:
            return None

    def _accept(self, batch: ExecuteBatch) -> None:
        """A group joins the running set (or waits for room in it, and says so), or runs
        whole."""
        if self.rows.takes(batch):
            self.batch_id, self.joined = batch.batch_id, []
            if not self._guard(self.rows.add, batch) and self.reports:
                self.send(Held(batch.batch_id))
        else:
            self.run_batch(batch)

    def _step_set(self) -> None:
        lane = self.rows.next_lane()  # (the lane whose groups this step's Progress names)
        ids = lane.batch_ids
        self.batch_id, self.joined = ids[0], ids[1:]
        self._guard(self.rows.step, lane)
        while (batch := self.rows.next_waiting()) is not None:  # rows left the set: room now
            if self.rows.takes(batch):
                self.batch_id, self.joined = batch.batch_id, []
                self._guard(self.rows.place, batch)
            else:
                self.run_batch(batch)

    def _validate(self, batch: ExecuteBatch) -> list[StageRequest]:
        """The batch's requests the stage takes; the others are answered now."""
        assert self.stage is not None
        valid = []
        for req in batch.requests:
            try:
                self.stage.validate(req)
                valid.append(req)
            except InvalidRequestError as exc:
                out = StageOutput.from_error(req.request_id, exc, self.name)
                self._result(batch.batch_id, out)
        return valid

    def _set_left(self, part: Deferred | None, ended: list[Group], owners: dict[str, int]) -> None:
        """What left the running set at one step boundary: the requests that ended (their rest,
        one decode) and the groups none of whose requests is left (they leave the critical
        path now; their BatchDone follows their last results) - to the finisher, as one job."""
        now = time.monotonic()
        parts: list[Deferred | StageOutput] = [part] if part is not None else []
        job = Job(-1, list(owners), now, self.control.max_model_batch, parts)
        job.owners, job.groups = owners, ended
        for group in ended:  # (CFG-parallel's rank 1 served their steps: it serves the next)
            self._guard(self._end_branches, group.batch_id)
        job.phases["denoise"] = max((now - g.started for g in ended), default=0.0)
        self._hand_over(job)

    def run_batch(self, batch: ExecuteBatch) -> None:
        assert self.stage is not None
        job = Job(batch.batch_id, [r.request_id for r in batch.requests], time.monotonic())
        self.batch_id, self.joined = batch.batch_id, []
        self.control.max_model_batch = 0
        valid = self._validate(batch)
        report = functools.partial(self._deliver, job.batch_id)
        self.control.report = report  # a row that ends early goes out at once
        try:
            job.parts = self._guard(begin_isolated, self.stage, valid, self.control, report)
        finally:  # however it went, a CFG-parallel rank 1 goes back to its pipe
            self.control.report = None
            self._guard(self._end_branches, job.batch_id)
        job.model_batch = self.control.max_model_batch
        job.phases["denoise"] = time.monotonic() - job.started
        self._hand_over(job)

    def _hand_over(self, job: Job) -> None:
        """The job's rest (its decode) on the finisher, beside what runs next (here, without
        decode overlap), in order; past the finisher's depth, wait for the oldest."""
        if not self.config.decode_overlap:  # its rest here, before the next batch begins
            self.finisher.wait_idle()
            self._finish_job(job)
            return
        # say this one may be followed: its rest (the decode) runs beside the next batch
        if self.reports:
            for batch_id, _, _ in job.ends():
                self.send(Denoised(batch_id))
        self.finisher.put(job)

    def _serve(self, batch_id: int) -> None:
        assert self.stage is not None
        try:
            self.stage.serve_branches(batch_id)
        except Exception as exc:  # the ranks no longer agree: the replica restarts whole
            raise FatalStageError(f"rank {self.rank}: {type(exc).__name__}: {exc}") from exc

    def _end_branches(self, batch_id: int, decoded: bool = False) -> None:
        """The other ranks stop serving batch `batch_id`: CFG-parallel's rank 1 once its
        denoising is over, sequence parallelism's once its decode is too (they decode it)."""
        at_decode = self.config.sequence_parallel > 1
        if self.stage is not None and self.config.leads and decoded == at_decode:
            try:
                self.stage.end_branches(batch_id)
            except Exception as exc:
                raise FatalStageError(f"rank 0: {type(exc).__name__}: {exc}") from exc

    def _finish_or_exit(self, job: Job) -> None:
        """On the finisher thread: the job's rest, then its results."""
        try:
            self._finish_job(job)
        except BaseException:
            # not a request's failure (those are outputs): without this thread the worker
            # cannot go on, so it dies now and the executor's monitor sees it at once
            logger.exception("stage %s: the finisher thread failed, worker exits", self.name)
            sys.stderr.flush()
            os._exit(EXIT_FATAL)

    def _finish_job(self, job: Job) -> None:
        assert self.stage is not None

        def report(out: StageOutput) -> None:
            self._deliver(job.owner(out.request_id), out)

        started = time.monotonic()
        outputs = self._guard(finish_parts, self.stage, job.parts, self.control, report)
        job.phases["finish"] = time.monotonic() - started
        self._complete(job, outputs)

    def _guard(self, run: Callable[..., T], *args: Any) -> T:
        try:
            return run(*args)
        except FatalStageError as exc:
            logger.error("stage %s: fatal device error, worker exits: %s", self.name, exc)
            sys.stderr.flush()
            os._exit(EXIT_FATAL)

    def _deliver(self, batch_id: int, out: StageOutput) -> None:
        """One result out now (bisection calls it for a culprit the moment it is found, a stage
        for a row that ended early); each request's output goes out once."""
        sent = self.sent.setdefault(batch_id, set())
        if out.request_id in sent:
            return
        out.steps_run = self.control.steps_run.get(out.request_id, out.steps_run)
        if not self.control.is_aborted(out.request_id):
            sent.add(out.request_id)
            self._result(batch_id, out)

    def _complete(self, job: Job, outputs: list[StageOutput]) -> None:
        """The job's results (not the aborted ones), then the BatchDone of each group it ends."""
        for out in outputs:
            self._deliver(job.owner(out.request_id), out)
        for batch_id, ids, started in job.ends():
            self._guard(self._end_branches, batch_id, True)
            if self.reports:
                steps = {rid: self.control.steps_run.get(rid, 0) for rid in ids}
                after = self.control.steps_after_abort(ids)
                elapsed = time.monotonic() - started
                memory = gpu_memory_in_use()
                done = BatchDone(
                    batch_id, len(ids), job.model_batch, elapsed, steps, after, memory, job.phases
                )
                done.offload = None if self.stage is None else self.stage.offload()
                self.send(done)
            self.sent.pop(batch_id, None)
            self.control.forget(ids)

    def _result(self, batch_id: int, out: StageOutput) -> None:
        if self.reports:
            self.send(RequestResult(batch_id, out))


def _process_local_locks() -> None:
    """Progress bars (tqdm, inside diffusers and transformers) lock through a multiprocessing
    RLock by default: in a spawned process, a named semaphore in /dev/shm that a killed worker
    leaves behind, one per death. No other process shares this worker's progress bars: a
    thread lock does, and nothing of a dead worker outlives it."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm comes with diffusers and transformers
        return
    tqdm.set_lock(threading.RLock())


def worker_main(
    conn: Connection,
    config: StageConfig,
    rank: int,
    device: str,
    faults: tuple[FaultRule, ...],
    parent_pid: int,
    rendezvous: str = "",
    peers: tuple[str, ...] = (),
    environ: dict[str, str] | None = None,
    streams: tuple[int, int] | None = None,
) -> None:
    """Entry point of a worker process (`peers`: the other ranks' devices; `environ` and
    `streams`: the engine's environment, stdout and stderr at this start, for a worker of the
    fork server)."""
    process_life.adopt(environ, streams)
    process_life.name_process()
    device = placement.pin(device, peers)  # first: nothing may have touched CUDA yet
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1`: every thread's stack
    threading.Thread(target=process_life.watch_engine, args=(parent_pid,), daemon=True).start()
    run_worker(transport.PipeChannel(conn), config, rank, device, faults, rendezvous)


def run_worker(
    channel: transport.Channel,
    config: StageConfig,
    rank: int,
    device: str,
    faults: tuple[FaultRule, ...],
    rendezvous: str = "",
) -> None:
    """A worker's life once its device is pinned: load, then serve batches until `Shutdown`
    (a process of its own, or a Ray actor's thread); exits the process on a fatal error."""
    if config.compile:
        placement.share_compile_cache(config.compile_cache)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s [{config.name}:{rank}] %(levelname)s %(message)s"
    )
    _process_local_locks()
    ranks = Ranks(rank, config.workers_per_replica, rendezvous, config.sequence_parallel)
    worker = _Worker(channel, config, ranks, device, faults)
    if not worker.load():
        sys.exit(1)
    if config.compile:  # after the load: its warm-up compiles count against the load timeout
        worker.report_compiles()
    process_life.freeze_heap()  # (what the load made stays: no full collection walks it)
    threading.Thread(target=worker.receive_forever, daemon=True, name="receiver").start()
    threading.Thread(target=worker.finisher.run_forever, daemon=True, name="finisher").start()
    worker.run_forever()
    if worker.stage is not None:
        worker.stage.close()
