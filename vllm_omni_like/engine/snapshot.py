"""What other threads may know of the engine: an immutable snapshot the orchestrator thread
publishes at the end of each pass of its loop (and at once when the engine dies). The event
loop's admission, `/health` and `/metrics` read only this; none of them touches a pool across
threads."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from vllm_omni_like.errors import ErrorInfo


@dataclass(frozen=True)
class StageView:
    pipeline: str
    name: str
    state: str  # starting | ready | restarting | dead
    waiting: int  # requests queued for the stage
    running: int  # requests in the replicas' batches (denoising, or still decoding)
    replicas_live: int
    replicas_total: int
    restarts: int
    restart_error: str | None = None  # why a restart under way is not done yet

    def health(self) -> dict[str, object]:
        body: dict[str, object] = {
            "pipeline": self.pipeline,
            "name": self.name,
            "state": self.state,
            "replicas_live": self.replicas_live,
            "replicas_total": self.replicas_total,
            "restarts": self.restarts,
        }
        if self.restart_error:
            body["restart_error"] = self.restart_error
        return body


@dataclass(frozen=True)
class EngineSnapshot:
    stages: tuple[StageView, ...]
    dead: ErrorInfo | None = None  # set once the engine is dead, for good

    def of(self, pipeline: str) -> tuple[StageView, ...]:
        return tuple(s for s in self.stages if s.pipeline == pipeline)


def take(pools: Iterable, dead: ErrorInfo | None) -> EngineSnapshot:
    """Read the pools (on the orchestrator thread, or before it runs) into a snapshot."""
    views = []
    for pool in pools:
        replicas = pool.replicas
        errors = [r.restart_error for r in replicas if r.restart_error]
        views.append(
            StageView(
                pipeline=pool.pipeline,
                name=pool.name,
                state=pool.state,
                waiting=len(pool.waiting),
                running=sum(len(r.running) for r in replicas),
                replicas_live=pool.live_count,
                replicas_total=len(replicas),
                restarts=sum(r.restarts for r in replicas),
                restart_error=errors[0] if errors else None,
            )
        )
    return EngineSnapshot(tuple(views), dead)
