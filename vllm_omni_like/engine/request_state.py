"""Per-request state owned by the orchestrator thread, and the final-status bookkeeping."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from vllm_omni_like.errors import (
    DeathCause,
    EngineDeadError,
    EngineGenerateError,
    ErrorKind,
    OmniError,
)
from vllm_omni_like.inputs import OmniRequest
from vllm_omni_like.outputs import RequestEvent, StageOutput
from vllm_omni_like.wire import StageRequest


class Queue(Protocol):
    """Where a request waits for its current stage (`StagePool`, which imports this module)."""

    def enqueue(self, state: RequestState, front: bool = False) -> None: ...


# how a request can end: success, or the final status of its error's kind
FINAL_STATUSES = ("success", *dict.fromkeys(kind.value.final for kind in ErrorKind))


@dataclass(eq=False)  # one object per request: equality is identity (never compare outputs)
class RequestState:
    request: OmniRequest
    emit: Callable[[RequestEvent], None]
    deadline: float
    created: float = field(default_factory=time.monotonic)
    stage_index: int = 0
    stage_request: StageRequest | None = None  # (`staged`: once it entered a stage)
    outputs: dict[str, StageOutput] = field(default_factory=dict)
    retries: int = 0  # re-queues after a replica death
    deaths: int = 0  # worker deaths this request was present at
    cohort: int | None = None  # the suspects it re-runs with, alone on a replica (deaths.py)
    chain: set[int] = field(default_factory=set)  # deaths it was at since it last ran clean
    replica: int | None = None  # where it runs now, if running
    stage_started: float = 0.0
    enqueued_at: float = 0.0  # when it joined its stage's queue (the batch policy's clock)
    units: tuple[float, ...] = ()  # its work at each stage, as admitted (cost.py)
    finished: bool = False
    partials_sent: int = 0  # partial images emitted: such a stream is never re-run
    pool: Queue | None = None  # its current stage's (set by the orchestrator)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def staged(self) -> StageRequest:
        """Its request to the stage it is at (set as it enters one)."""
        if self.stage_request is None:
            raise RuntimeError(f"request {self.request.request_id} has entered no stage")
        return self.stage_request


def after_death(
    state: RequestState,
    stage: str,
    pool_state: str,
    cause: DeathCause,
    detail: str,
    max_retries: int,
    charged: bool = True,
    convicted: bool = False,
) -> OmniError | None:
    """What becomes of a request its worker died under: None to re-run it (from this stage,
    earlier stages' outputs reused), else the error it ends with. `detail`: the stall's reason,
    or how the worker exited; `charged`: the death may be this request's doing (its `chain`
    already holds it); `convicted`: it was, as it ran as a cohort of one (engine/deaths.py)."""
    worker = f"worker {detail}" if cause is DeathCause.CRASHED else f"worker stalled ({detail})"
    if state.partials_sent:  # a re-run would stream its partial images a second time
        return EngineGenerateError(
            f"{worker} after {state.partials_sent} partial image(s) were streamed; "
            "a stream is not re-run",
            stage=stage,
        )
    if convicted:  # a poison request must not take every replica down
        times = "twice" if len(state.chain) == 2 else f"{len(state.chain)} times"
        reason = "" if cause is DeathCause.CRASHED else f" ({detail})"
        return EngineGenerateError(
            f"request {cause.value} {times}{reason}; it is not retried", stage=stage
        )
    if pool_state == "dead":
        return EngineDeadError(f"{worker}; no live replica and no restart left", stage=stage)
    if charged and state.cohort is None and state.retries >= max_retries:
        return EngineGenerateError(
            f"{worker} while running this request; no retry left", stage=stage
        )
    return None


@dataclass(frozen=True)
class BatchReport:
    """A batch a stage finished, as its worker counted it: for metrics and observers."""

    stage: str
    size: int
    steps_run: dict[str, int]  # per request, aborted ones included
    steps_after_abort: dict[str, int]  # per aborted request: steps run after the abort arrived
    model_batch: int = 0  # the largest batch dimension the model itself saw (rank 0's)
    phases: dict[str, float] = field(default_factory=dict)  # seconds: denoise, finish


class EngineStats:
    """Counters every admitted request ends in exactly once; read from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests_total = 0
        self.final: Counter[str] = Counter()
        self.rejected: Counter[int] = Counter()  # refused before admission (the API counts)
        self.stage_requests: Counter[str] = Counter()  # requests dispatched, per stage
        self.batch_sizes: Counter[int] = Counter()
        self.worker_deaths = 0
        self.restarts = 0
        self.compiles = 0  # torch.compile compilations the workers reported starting
        self.latency_s: dict[str, list[float]] = {s: [] for s in FINAL_STATUSES}
        self.observers: list[Callable[[str, str, float], None]] = []  # pipeline, status, s
        self.stage_observers: list[Callable[[str, float], None]] = []  # stage, seconds
        self.batch_observers: list[Callable[[BatchReport], None]] = []

    def stage_done(self, stage: str, seconds: float) -> None:
        for observe in self.stage_observers:
            observe(stage, seconds)

    def batch_done(self, report: BatchReport) -> None:
        with self._lock:
            self.batch_sizes[report.size] += 1
        for observe in self.batch_observers:
            observe(report)

    def restarted(self) -> None:
        with self._lock:
            self.restarts += 1

    def compiled(self) -> None:
        with self._lock:
            self.compiles += 1

    def worker_died(self) -> None:
        with self._lock:
            self.worker_deaths += 1

    def dispatched(self, stage: str, n: int) -> None:
        with self._lock:
            self.stage_requests[stage] += n

    def admitted(self) -> None:
        with self._lock:
            self.requests_total += 1

    def finished(self, pipeline: str, status: str, latency_s: float) -> None:
        with self._lock:
            self.final[status] += 1
            samples = self.latency_s[status]
            samples.append(latency_s)
            if len(samples) > 10_000:
                del samples[: len(samples) // 2]
        for observe in self.observers:
            observe(pipeline, status, latency_s)

    def reject(self, status: int) -> None:
        with self._lock:
            self.rejected[status] += 1

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "requests_total": self.requests_total,
                "final": {s: self.final[s] for s in FINAL_STATUSES},
                "rejected": dict(self.rejected),
                "stage_requests": dict(self.stage_requests),
                "batch_sizes": dict(self.batch_sizes),
                "worker_deaths": self.worker_deaths,
                "restarts": self.restarts,
                "compiles": self.compiles,
            }
