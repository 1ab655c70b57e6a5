"""Starting the replicas of one stage: the first start (all in parallel), each restart on a
thread of its own after its delay, and a shutdown that also stops whatever is still loading."""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable, Iterable
from typing import TypeVar

from vllm_omni_like.errors import ShuttingDownError
from vllm_omni_like.executor import Executor

# a start that failed for these lacked room on the host (descriptors, memory, processes),
# which frees up on its own: it is retried without spending the replica's restart budget
NO_ROOM_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN})
NO_ROOM_TEXTS = ("Too many open files", "Cannot allocate memory")  # as a worker reports them
T = TypeVar("T")


def lacks_room(exc: BaseException) -> bool:
    """Whether a start failed for lack of host resources rather than for the model."""
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, OSError) and exc.errno in NO_ROOM_ERRNOS:
        return True
    return any(text in str(exc) for text in NO_ROOM_TEXTS)


def in_parallel(start: Callable[[T], object], items: Iterable[T]) -> list[BaseException]:
    """Call `start` on every item, each on a thread of its own; the failures."""
    errors: list[BaseException] = []

    def run(item: T) -> None:
        try:
            start(item)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(item,)) for item in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


class ReplicaStarter:
    """Creates and starts executors; `shutdown()` stops every one not yet handed over."""

    def __init__(self, name: str, make_executor: Callable[[int], Executor]) -> None:
        self.name = name
        self.make_executor = make_executor
        self.stopping = threading.Event()
        self._starting: set[Executor] = set()  # created, not yet handed over to the pool
        self._lock = threading.Lock()

    def start(self, index: int) -> Executor:
        """Create and start replica `index`'s executor (blocks while it loads)."""
        executor = self.make_executor(index)
        with self._lock:  # shutdown() sees it from here on: nothing outlives it
            if self.stopping.is_set():
                raise ShuttingDownError("the engine shut down while loading", stage=self.name)
            self._starting.add(executor)
        try:
            executor.start()
        except BaseException:
            self.handed_over(executor)
            raise
        return executor

    def start_all(self, indices: list[int]) -> tuple[dict[int, Executor], list[BaseException]]:
        """The first start: every replica in parallel; the executors and the failures."""
        started: dict[int, Executor] = {}

        def start_one(index: int) -> None:
            started[index] = self.start(index)

        return started, in_parallel(start_one, indices)

    def restart_later(
        self,
        index: int,
        delay: float,
        on_started: Callable[[Executor], None],
        on_failed: Callable[[BaseException], None],
    ) -> None:
        """After `delay`, start replica `index` on a thread; report the outcome (unless the
        pool shut down meanwhile, when whatever started is stopped again)."""

        def run() -> None:
            if self.stopping.wait(delay):
                return
            try:
                executor = self.start(index)
            except Exception as exc:
                if not self.stopping.is_set():
                    on_failed(exc)
                return
            if self.stopping.is_set():
                executor.shutdown()
                return
            on_started(executor)

        threading.Thread(target=run, daemon=True, name=f"restart-{self.name}").start()

    def handed_over(self, executor: Executor) -> None:
        with self._lock:
            self._starting.discard(executor)

    def shutdown(self) -> list[Executor]:
        """Stop starting anything; the executors still starting (the caller shuts them down)."""
        with self._lock:
            self.stopping.set()
            return list(self._starting)
