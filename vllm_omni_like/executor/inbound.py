"""What a replica's workers send, sorted the same way whatever carries it (a pipe, Ray).

Startup answers (`WorkerReady`, `WorkerLoadFailed`) go to `startup`, read by the executor's
start; results of requests still in flight, their batches' ends, progress, `Denoised`, `Held`
and `Compiling` go to the owner's sink; a result for a request no longer the replica's (a
second copy, one sent after a death listed it as lost) is dropped. A death takes what is in
flight (`lost`): no result and no `BatchDone` is made up for it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from vllm_omni_like.errors import EngineDeadError
from vllm_omni_like.executor.base import Executor, FailureCallback, MessageSink
from vllm_omni_like.wire import (
    BatchDone,
    Compiling,
    Denoised,
    Held,
    Progress,
    ReplicaDied,
    RequestResult,
    WorkerLoadFailed,
    WorkerReady,
)

logger = logging.getLogger(__name__)


class Inbound:
    def __init__(self, sink: MessageSink) -> None:
        self.sink = sink
        self.startup: queue.Queue[object] = queue.Queue()
        self.last_activity = time.monotonic()  # of the last message (progress counts)
        self._lock = threading.Lock()
        self._batches: dict[int, set[str]] = {}

    def sent(self, batch_id: int, request_ids: set[str]) -> None:
        with self._lock:
            self._batches[batch_id] = request_ids

    def route(self, msg: object) -> None:
        """Called on the thread that read `msg`."""
        self.last_activity = time.monotonic()
        match msg:
            case WorkerReady() | WorkerLoadFailed():
                self.startup.put(msg)
            case RequestResult(batch_id=bid, output=out):
                with self._lock:
                    pending = self._batches.get(bid)
                    if pending is None or out.request_id not in pending:
                        return
                    pending.discard(out.request_id)
                self.sink(msg)
            case BatchDone(batch_id=bid):
                with self._lock:
                    self._batches.pop(bid, None)
                self.sink(msg)
            case Progress() | Denoised() | Held() | Compiling():
                self.sink(msg)

    def lost(self) -> list[str]:
        """Every request in flight, taken: from now on their results are dropped."""
        with self._lock:
            batches, self._batches = self._batches, {}
        return [rid for ids in batches.values() for rid in sorted(ids)]

    @property
    def requests(self) -> set[str]:
        with self._lock:
            return set().union(*self._batches.values()) if self._batches else set()


class InboundExecutor(Executor):
    """What both executors keep the same way: the sorted inbound messages, the failure
    callbacks (each fired once per death, by `_report`), and the alive / stopping state."""

    def __init__(self, sink: MessageSink) -> None:
        self._inbound = Inbound(sink)
        self._callbacks: list[FailureCallback] = []
        self._lock = threading.Lock()
        self._dead = False
        self._stopping = False
        self._kill_reason: str | None = None

    def _hello(self, msg: object, ready: set[int], stage: str, where: str) -> None:
        """A start-up answer: a ready rank joins `ready` (rank 0's devices and memory are
        kept); a load failure is logged with its traceback and raised."""
        match msg:
            case WorkerReady(rank=rank) as hello:
                ready.add(rank)
                if rank == 0:
                    self.visible_devices, self.gpu_memory = hello.visible_devices, hello.gpu_memory
                    self.stepped, self.precision = hello.stepped, hello.precision
                    self.start_report, self.offload = hello.start, hello.offload
            case WorkerLoadFailed(error=info, traceback=tb):
                logger.error("stage %s %s failed to load:\n%s", stage, where, tb)
                raise EngineDeadError(f"{where}: {info.message}", stage=stage)

    def add_failure_callback(self, callback: FailureCallback) -> None:
        self._callbacks.append(callback)

    def _report(self, event: ReplicaDied) -> None:
        for cb in self._callbacks:
            try:
                cb(event)
            except Exception:
                logger.exception("failure callback raised")

    @property
    def alive(self) -> bool:
        return not self._dead and not self._stopping

    @property
    def in_flight(self) -> set[str]:
        return self._inbound.requests

    @property
    def last_activity(self) -> float:
        return self._inbound.last_activity
