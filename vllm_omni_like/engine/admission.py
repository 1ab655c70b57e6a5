"""How much work a pipeline takes in: requests admitted and not yet ended, counted in requests
(a bound on memory) and in seconds of work at the replicas' measured speed (cost.py).

Admission runs on the event loop's thread and reads the engine snapshot for the stages' speeds;
what it counts is its own, under its own lock (the orchestrator thread releases it).
"""

from __future__ import annotations

import math
import threading
from collections import Counter

from vllm_omni_like.engine.snapshot import StageView, drain_seconds
from vllm_omni_like.errors import QueueFullError


class Admission:
    def __init__(self, max_requests: int, max_seconds: float) -> None:
        self.max_requests = max_requests
        self.max_seconds = max_seconds
        self._lock = threading.Lock()
        self._count: Counter[str] = Counter()
        self._units: dict[str, list[float]] = {}  # per pipeline: work held at each stage

    def admit(self, pipeline: str, units: tuple[float, ...], stages: tuple[StageView, ...]) -> None:
        """Count the request in, or raise 429 `queue_full` with `Retry-After` in seconds of
        work: what must drain before it fits. A request alone is always admitted."""
        with self._lock:
            count = self._count[pipeline]
            held = self._units.setdefault(pipeline, [0.0] * len(units))
            held_s = drain_seconds(held, stages)
            if count >= self.max_requests:
                per_request = held_s / count if held_s is not None and count else 1.0
                raise QueueFullError(
                    f"pipeline {pipeline!r} has {self.max_requests} requests waiting or running "
                    "(--max-queue-size); retry later",
                    retry_after=_whole_seconds(per_request),
                )
            after = drain_seconds([h + u for h, u in zip(held, units, strict=True)], stages)
            if count and self.max_seconds > 0 and after is not None and after > self.max_seconds:
                raise QueueFullError(
                    f"pipeline {pipeline!r} holds {held_s or 0.0:.1f}s of work; with this "
                    f"request {after:.1f}s, over --max-queue-seconds {self.max_seconds:g}; "
                    f"retry in {_whole_seconds(after - self.max_seconds):d}s",
                    retry_after=_whole_seconds(after - self.max_seconds),
                )
            self._count[pipeline] += 1
            for i, u in enumerate(units):
                held[i] += u

    def release(self, pipeline: str, units: tuple[float, ...]) -> None:
        with self._lock:
            self._count[pipeline] -= 1
            held = self._units[pipeline]
            for i, u in enumerate(units):
                held[i] = 0.0 if self._count[pipeline] == 0 else max(0.0, held[i] - u)

    def held(self, pipeline: str) -> tuple[int, tuple[float, ...]]:
        with self._lock:
            return self._count[pipeline], tuple(self._units.get(pipeline, ()))


def _whole_seconds(seconds: float) -> int:
    return max(1, math.ceil(seconds))
