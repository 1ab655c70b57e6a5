"""A worker as a Ray actor: the same worker loop as a spawned process, behind a Ray channel.

The actor runs `run_worker` on a thread of its own. The executor reaches it through two
concurrency groups, so that nothing waits behind a running batch: `control` (`deliver`: a
batch, an abort, a shutdown, put on the worker's inbox at once; `join`) and `events` (the one
long-poll call the executor keeps outstanding: it returns every message the worker queued,
waiting up to a bound for the first). Ray carries the arrays of results through its object
store. A fatal error ends the actor's process (`os._exit`, as in a spawned worker): the
outstanding `events` call then fails with `RayActorError`, which is the executor's death signal.
Ray itself never restarts it (`max_restarts=0`): the pool restarts replicas.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from typing import Any

from vllm_omni_like.config import FaultRule, StageConfig
from vllm_omni_like.executor.worker import run_worker

EVENTS_WAIT_S = 1.0  # an idle long-poll answers empty after this, so a caller may stop asking
CONCURRENCY = {"control": 2, "events": 1}


class RayChannel:
    """The actor's end: what `deliver` puts comes out of `recv`; what the worker sends waits
    in the outbox for the executor's long-poll."""

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def send(self, msg: object) -> None:
        self.outbox.put(msg)

    def recv(self) -> object:
        return self.inbox.get()

    def drain(self, wait: float) -> list[object]:
        try:
            found = [self.outbox.get(timeout=wait)]
        except queue.Empty:
            return []
        while True:
            try:
                found.append(self.outbox.get_nowait())
            except queue.Empty:
                return found


class WorkerActor:
    """Decorated with `ray.remote` by the executor (this module imports no Ray)."""

    def __init__(
        self,
        config: StageConfig,
        rank: int,
        device: str,
        faults: tuple[FaultRule, ...],
    ) -> None:
        self.channel = RayChannel()
        self.thread = threading.Thread(
            target=self._run, args=(config, rank, device, faults), daemon=True, name="worker"
        )
        self.thread.start()

    def _run(
        self, config: StageConfig, rank: int, device: str, faults: tuple[FaultRule, ...]
    ) -> None:
        with contextlib.suppress(SystemExit):  # a load failure: WorkerLoadFailed went out
            run_worker(self.channel, config, rank, device, faults)

    def deliver(self, msg: object) -> None:
        self.channel.inbox.put(msg)

    def events(self, wait: float = EVENTS_WAIT_S) -> list[object]:
        return self.channel.drain(wait)

    def join(self, timeout: float) -> bool:
        """Whether the worker loop ended (after `Shutdown`) within `timeout` seconds."""
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def pid(self) -> int:
        return os.getpid()
