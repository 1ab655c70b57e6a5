"""The multi-process executor: spawn the workers of one replica, read them, watch them die."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import queue
import shutil
import signal
import tempfile
import threading
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.context import ForkServerContext, SpawnContext

from vllm_omni_like.config import FaultRule, StageConfig
from vllm_omni_like.errors import EngineDeadError, ShuttingDownError
from vllm_omni_like.executor import placement, process_life, start_method, transport
from vllm_omni_like.executor.base import MessageSink
from vllm_omni_like.executor.inbound import InboundExecutor
from vllm_omni_like.executor.worker import worker_main
from vllm_omni_like.wire import AbortRequests, ExecuteBatch, FollowBatch, ReplicaDied, Shutdown

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0
# messages waiting for a worker's writer thread; a worker that lets this many pile up has
# stopped reading its pipe (stopped, or hung) and is killed
OUTBOX_MAX = 256


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class _WorkerHandle:
    def __init__(self, rank: int, proc: mp.process.BaseProcess, conn: Connection) -> None:
        self.rank = rank
        self.proc = proc
        self.conn = conn
        self.send_lock = threading.Lock()
        self.reader: threading.Thread | None = None
        # the one thread that writes to the worker's pipe, so that no thread of the engine
        # (the orchestrator runs deadlines, stall checks and /health) blocks on a full pipe
        self.outbox: queue.Queue[object | None] = queue.Queue(OUTBOX_MAX)
        self.writer: threading.Thread | None = None


class MultiprocExecutor(InboundExecutor):
    """Workers of one stage replica as spawned processes, with a monitor thread on sentinels."""

    def __init__(
        self,
        config: StageConfig,
        replica: int,
        sink: MessageSink,
        faults: tuple[FaultRule, ...] = (),
    ) -> None:
        super().__init__(sink)
        self.config = config
        self.replica = replica
        self.faults = faults
        self.devices = placement.rank_devices(config, replica)  # one per rank
        self.start_method = start_method.method_for(config, self.devices)  # spawn | forkserver
        # the ranks of a replica rank 0 leads (CFG-parallel, sequence parallel) meet through a
        # file here (torch.distributed's store)
        self._rendezvous = tempfile.mkdtemp(prefix="omni-ranks-") if config.leads else ""
        self._workers: list[_WorkerHandle] = []
        self._ready: set[int] = set()  # ranks whose load finished
        self._wake_r, self._wake_w = mp.Pipe(duplex=False)
        self._monitor: threading.Thread | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        ctx = start_method.context(self.start_method)
        try:
            for rank in range(self.config.workers_per_replica):
                with self._lock:  # shutdown() either sees this worker or stops the spawning
                    if self._stopping:
                        break
                    self._spawn(ctx, rank)
            self._wait_ready()
        except BaseException:  # out of descriptors, a load failure, a shutdown: nothing left
            self.shutdown()
            raise
        self._monitor = threading.Thread(
            target=self._monitor_forever,
            daemon=True,
            name=f"monitor-{self.config.name}-r{self.replica}",
        )
        self._monitor.start()

    def _spawn(self, ctx: SpawnContext | ForkServerContext, rank: int) -> None:
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        forked = self.start_method == "forkserver"  # (a spawned worker inherits both)
        proc = ctx.Process(
            target=worker_main,
            args=(
                child_conn,
                self.config,
                rank,
                self.devices[rank],
                self.faults,
                os.getpid(),
                os.path.join(self._rendezvous, "store") if self._rendezvous else "",
                self.devices[:rank] + self.devices[rank + 1 :],
                *((dict(os.environ), process_life.engine_streams()) if forked else ()),
            ),
            name=f"{self.config.name}-r{self.replica}-w{rank}",
            daemon=True,
        )
        try:
            proc.start()
        except BaseException:  # e.g. out of descriptors: the pipe goes too
            parent_conn.close()
            child_conn.close()
            raise
        child_conn.close()  # so the reader sees EOF when the worker dies
        handle = _WorkerHandle(rank, proc, parent_conn)
        for role, loop in (("reader", self._read_forever), ("writer", self._write_forever)):
            thread = threading.Thread(
                target=loop, args=(handle,), daemon=True, name=f"{role}-{proc.name}"
            )
            setattr(handle, role, thread)
            thread.start()
        self._workers.append(handle)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.load_timeout
        ready = self._ready
        where = f"replica {self.replica}"
        while len(ready) < self.config.workers_per_replica:
            if self._stopping:  # shutdown() during the load: it ends the workers
                raise ShuttingDownError(
                    f"{where}: loading stopped: the engine is shutting down",
                    stage=self.config.name,
                )
            try:
                msg = self._inbound.startup.get(timeout=0.05)
            except queue.Empty:
                msg = None
            if msg is None:
                for w in self._workers:
                    if self._stopping:
                        break  # the check above says why
                    if w.proc.exitcode is not None and w.rank not in ready:
                        time.sleep(0.05)  # a load failure message may still be in the pipe
                        if self._inbound.startup.empty():
                            raise EngineDeadError(
                                f"{where}: worker {w.rank} {describe_exit(w.proc.exitcode)} "
                                "while loading",
                                stage=self.config.name,
                            )
                if time.monotonic() > deadline:
                    raise EngineDeadError(
                        f"{where}: load timed out after {self.config.load_timeout:.0f}s",
                        stage=self.config.name,
                    )
                continue
            self._hello(msg, ready, self.config.name, where)

    def shutdown(self) -> None:
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        self._wake_w.send_bytes(b"x")
        self._send_all(Shutdown())
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for w in self._workers:
            if w.rank in self._ready:  # a loading worker reads no message: killed at once
                w.proc.join(max(0.0, deadline - time.monotonic()))
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(5)
        for w in self._workers:
            with contextlib.suppress(queue.Full):  # full: the writer is mid-send, and errs
                w.outbox.put_nowait(None)
            if w.writer is not None:
                w.writer.join(2)
            w.conn.close()
            if w.reader is not None:
                w.reader.join(2)
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(2)
        self._wake_r.close()
        self._wake_w.close()
        for w in self._workers:
            w.proc.close()
        if self._rendezvous:
            shutil.rmtree(self._rendezvous, ignore_errors=True)
        self._dead = True

    # ---- work --------------------------------------------------------------------------------
    def execute(self, batch: ExecuteBatch) -> None:
        with self._lock:
            if self._dead or self._stopping:
                raise EngineDeadError(f"replica {self.replica} is dead", stage=self.config.name)
            self._inbound.sent(batch.batch_id, {r.request_id for r in batch.requests})
        if self.config.leads:  # rank 0 runs the batch; the others serve its denoiser calls
            self._send_all(batch, self._workers[:1])
            self._send_all(FollowBatch(batch.batch_id), self._workers[1:])
        else:
            self._send_all(batch)

    def abort(self, request_ids: list[str]) -> None:
        # the ranks rank 0 leads hold no requests: aborts are rank 0's to apply
        to = self._workers[:1] if self.config.leads else self._workers
        self._send_all(AbortRequests(list(request_ids)), to)

    def _send_all(self, msg: object, workers: list[_WorkerHandle] | None = None) -> None:
        """Never blocks: each worker's writer thread does the sending."""
        for w in self._workers if workers is None else workers:
            try:
                w.outbox.put_nowait(msg)
            except queue.Full:
                self.kill(f"worker {w.rank} stopped reading its pipe ({OUTBOX_MAX} messages wait)")

    def _write_forever(self, w: _WorkerHandle) -> None:
        while (msg := w.outbox.get()) is not None:
            try:
                transport.send(w.conn, msg, w.send_lock)
            except (OSError, ValueError):
                return  # the worker is gone: its death is the monitor's to report

    def kill(self, reason: str) -> None:
        self._kill_reason = reason
        for w in self._workers:
            if w.proc.is_alive():
                w.proc.kill()

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers if w.proc.pid is not None]

    # ---- threads -----------------------------------------------------------------------------
    def _read_forever(self, w: _WorkerHandle) -> None:
        while True:
            try:
                msg = transport.recv(w.conn)
            except (EOFError, OSError, ValueError):
                return
            self._inbound.route(msg)

    def _monitor_forever(self) -> None:
        sentinels = {w.proc.sentinel: w for w in self._workers}
        ready = wait([*sentinels, self._wake_r])
        if self._stopping:
            return
        dead = next(sentinels[s] for s in ready if s in sentinels)
        self._on_death(dead)

    def _on_death(self, dead: _WorkerHandle) -> None:
        # 1) what happened
        dead.proc.join(0.1)
        desc = describe_exit(dead.proc.exitcode)
        if self._kill_reason:
            desc = f"{desc} ({self._kill_reason})"
        logger.error(
            "stage %s replica %d: worker %d (pid %s) %s",
            self.config.name,
            self.replica,
            dead.rank,
            dead.proc.pid,
            desc,
        )
        # 2) the replica is unusable: stop its other workers, drain what they already sent
        self.kill(self._kill_reason or f"worker {dead.rank} died")
        for w in self._workers:
            if w.reader is not None:
                w.reader.join(0.05)
        # 3) from now on nothing new is accepted; what was in flight is lost with the worker
        # (ReplicaDied lists it: no result and no BatchDone are made up for it)
        with self._lock:
            self._dead = True
            lost = self._inbound.lost()
        # 4) tell the owner, once
        self._report(ReplicaDied(self.config.name, self.replica, desc, lost))
