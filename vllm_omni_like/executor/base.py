"""The executor interface: one stage replica, however its workers are run (processes, Ray)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from vllm_omni_like.wire import (
    ExecuteBatch,
    FromWorker,
    Mode,
    OffloadReport,
    ReplicaDied,
    StartReport,
)

FailureCallback = Callable[[ReplicaDied], None]
MessageSink = Callable[[FromWorker], None]


class Executor(ABC):
    """Runs batches on the workers of one replica; reports results and its own death.

    Results, progress and failures reach the owner as messages through `sink` (called on the
    executor's threads; it must only enqueue). When a worker dies, each failure callback fires
    exactly once with a `ReplicaDied` that lists the requests lost with it (no results are made
    up for them).
    """

    gpu_memory: int = 0  # bytes its workers' CUDA allocators held when they last said
    visible_devices: str | None = None  # its workers' CUDA_VISIBLE_DEVICES
    stepped: tuple[Mode, ...] = ()  # modes whose rows join its running set (WorkerReady)
    precision: str | None = None  # what its model computes in (WorkerReady): fp8, bf16...
    start_report: StartReport | None = None  # its rank 0's start (WorkerReady)
    offload: OffloadReport | None = None  # its rank 0's idle-expert offload (WorkerReady)

    @abstractmethod
    def start(self) -> None:
        """Start the workers and wait until each has loaded its stage; raise on failure."""

    @abstractmethod
    def execute(self, batch: ExecuteBatch) -> None:
        """Send a batch; raises EngineDeadError if the replica is dead."""

    @abstractmethod
    def abort(self, request_ids: list[str]) -> None:
        """Ask the workers to stop these requests at their next step boundary."""

    @abstractmethod
    def add_failure_callback(self, callback: FailureCallback) -> None: ...

    @abstractmethod
    def kill(self, reason: str) -> None:
        """Kill the workers (a stalled replica); handled as a death."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers; idempotent; leaves no process behind."""

    @property
    @abstractmethod
    def alive(self) -> bool: ...

    @property
    @abstractmethod
    def in_flight(self) -> set[str]: ...

    @property
    @abstractmethod
    def last_activity(self) -> float:
        """time.monotonic() of the last message from a worker (progress counts)."""

    @property
    def pids(self) -> list[int]:
        """Its worker processes (on this host), for /health and operators."""
        return []
