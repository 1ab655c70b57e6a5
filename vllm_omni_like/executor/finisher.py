"""The worker's finisher: the deferred rest of each job (a batch's decode, or that of what left a
running set at a step) finished in order on its own thread, beside the main thread's next steps.

Up to `depth` jobs are pending (one finishing, the others waiting with their latents): the main
thread hands a job over without waiting until that many are pending, so a running set whose
rows end every few steps keeps its decode groups off its critical path; past that it waits for
the oldest (a bound on the memory jobs hold). An out-of-memory error on the main thread waits
for every pending job (`wait_idle`): their memory comes back.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

J = TypeVar("J")


class Finisher(Generic[J]):
    def __init__(self, finish: Callable[[J], None], depth: int = 2) -> None:
        self._finish = finish
        self.depth = depth
        self._jobs: queue.Queue[J] = queue.Queue()
        self._pending = 0
        self._changed = threading.Condition()

    @property
    def busy(self) -> bool:
        with self._changed:
            return self._pending > 0

    def put(self, job: J) -> None:
        """Queue `job`; wait first while `depth` jobs are pending."""
        with self._changed:
            while self._pending >= self.depth:
                self._changed.wait()
            self._pending += 1
        self._jobs.put(job)

    def wait_idle(self) -> bool:
        """Wait until no job is pending; whether one was."""
        with self._changed:
            was = self._pending > 0
            while self._pending:
                self._changed.wait()
            return was

    def run_forever(self) -> None:
        """The finisher thread: each job in order (an exception is the caller's: `finish` must
        not raise for a request's failure; the worker exits on anything else)."""
        while True:
            job = self._jobs.get()
            self._finish(job)
            del job  # its latents and pixels go now
            with self._changed:
                self._pending -= 1
                self._changed.notify_all()
