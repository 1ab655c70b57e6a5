"""One replica of a stage as the orchestrator sees it: its executor, its restarts, and the
batches it has in flight, bounded by credits.

A dispatch spends the replica's credit; the message that frees its critical path (`Denoised`:
the batch's denoising is done, its decode runs on the worker's finisher thread) returns it; the
batch's end (`BatchDone`) removes the batch, returning the credit if it had not come back. So a
replica holds at most one batch on its critical path and one being finished beside it, and the
stall bound looks at the oldest batch in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_omni_like.engine.request_state import RequestState
from vllm_omni_like.engine.stall import StepClock
from vllm_omni_like.executor import Executor

CREDITS = 1  # batches on the critical path at once
MAX_IN_FLIGHT = 2  # that one, and one whose rest (its decode) runs beside it


@dataclass
class InFlight:
    batch_id: int
    requests: list[RequestState]
    dispatched: float
    denoised: float | None = None  # when it left the critical path (its credit came back)


@dataclass
class Replica:
    index: int
    executor: Executor | None = None
    inflight: dict[int, InFlight] = field(default_factory=dict)  # by batch id, oldest first
    credits: int = CREDITS
    restarts: int = 0
    restarting: bool = False
    last_dispatch: float = 0.0
    stall_killed: bool = False
    started_at: float = 0.0
    backoff: int = 0  # index into RESTART_BACKOFF_S; back to 0 after a stable run
    no_room_since: float = 0.0  # restarts have lacked room on the host since then (0: they did not)
    restart_error: str | None = None  # why the last restart failed (until one succeeds)
    clock: StepClock | None = None  # its measured step speed: the running batch's stall bound

    @property
    def live(self) -> bool:
        return self.executor is not None and self.executor.alive and not self.restarting

    @property
    def can_take(self) -> bool:
        """Live, with a credit, and room for another batch in flight."""
        return self.live and self.credits > 0 and len(self.inflight) < MAX_IN_FLIGHT

    @property
    def critical(self) -> InFlight | None:
        """The batch on its critical path (dispatched, not yet denoised), if any."""
        return next((f for f in self.inflight.values() if f.denoised is None), None)

    @property
    def running(self) -> list[RequestState]:
        return [s for f in self.inflight.values() for s in f.requests]

    def holds(self, state: RequestState) -> bool:
        return any(state in f.requests for f in self.inflight.values())

    def dispatched(self, batch_id: int, requests: list[RequestState], now: float) -> None:
        self.credits -= 1
        self.inflight[batch_id] = InFlight(batch_id, requests, now)
        self.last_dispatch = now
        self.clock.begin([s.stage_request for s in requests], now)

    def undispatched(self, batch_id: int) -> None:
        """The dispatch did not reach the worker (it died just then)."""
        if self.inflight.pop(batch_id, None) is not None:
            self.credits += 1

    def denoised(self, batch_id: int, now: float) -> InFlight | None:
        batch = self.inflight.get(batch_id)
        if batch is None or batch.denoised is not None:
            return None
        batch.denoised = now
        self.credits += 1
        return batch

    def done(self, batch_id: int) -> InFlight | None:
        batch = self.inflight.pop(batch_id, None)
        if batch is not None and batch.denoised is None:
            self.credits += 1
        return batch

    def lost(self) -> None:
        """Its executor died: nothing is in flight any more."""
        self.inflight.clear()
        self.credits = CREDITS
