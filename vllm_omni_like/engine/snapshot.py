"""What other threads may know of the engine: an immutable snapshot the orchestrator thread
publishes at the end of each pass of its loop (and at once when the engine dies). The event
loop's admission, `/health` and `/metrics` read only this; none of them touches a pool across
threads."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from vllm_omni_like import cost
from vllm_omni_like.engine.replica import Replica
from vllm_omni_like.engine.stage_pool import StagePool
from vllm_omni_like.errors import ErrorInfo
from vllm_omni_like.models.limits import StageFamily
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.speed_settings import describe_cache
from vllm_omni_like.wire import OffloadReport, StartReport


@dataclass(frozen=True)
class ReplicaView:
    index: int
    device: str  # as the host names it (cuda:N, cpu, auto)
    state: str  # starting | ready | stalled | restarting | dead
    gpu_memory: int  # bytes its worker's CUDA allocator held when it last said (0: none)
    pids: tuple[int, ...] = ()  # its worker processes while live
    start: StartReport | None = None  # what its last start took and found
    restart_seconds: float | None = None  # its last restart, from the death to ready
    offload: OffloadReport | None = None  # its idle-expert offload (--offload idle-expert)

    def health(self) -> dict[str, object]:
        body: dict[str, object] = {
            "index": self.index,
            "device": self.device,
            "state": self.state,
            "gpu_memory_bytes": self.gpu_memory,
            "pids": list(self.pids),
        }
        if self.start is not None:
            body["start_seconds"] = round(self.start.seconds, 3)
            if self.start.cache_dir:  # (compiled)
                body["compile_cache"] = {
                    "dir": self.start.cache_dir,
                    "hits": self.start.cache_hits,
                    "misses": self.start.cache_misses,
                    "precompiled": self.start.precompiled,
                    "traced": self.start.traced,
                }
                body["cuda_graphs"] = list(self.start.graphs)
                body["cuda_graph_bytes"] = self.start.graph_bytes
        if self.restart_seconds is not None:
            body["restart_seconds"] = round(self.restart_seconds, 3)
        if (offload := self.offload) is not None:
            last = offload.last_swap_s
            body["offload"] = {
                "resident": offload.resident,
                "swaps": offload.swaps,
                "last_swap_seconds": None if last is None else round(last, 4),
                "device_bytes": offload.device_bytes,
                "host_bytes": offload.host_bytes,
            }
        return body


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
    # the cost model (cost.py): how the stage counts work, and how fast it goes
    text: bool = False
    default_steps: int = 1
    rate: float | None = None  # seconds per unit of work of its live replicas side by side
    replicas: tuple[ReplicaView, ...] = ()
    family: StageFamily | None = None  # a diffusion stage's family and its loops (per mode)
    precision: str | None = None  # what its model computes in (fp8, bf16...), once loaded
    cache: dict[str, object] | None = None  # its step cache (speed_settings.py); None: off
    offload: str = "none"  # --offload (idle-expert: its replicas say their resident expert)

    def health(self) -> dict[str, object]:
        body: dict[str, object] = {
            "pipeline": self.pipeline,
            "name": self.name,
            "state": self.state,
            "replicas_live": self.replicas_live,
            "replicas_total": self.replicas_total,
            "restarts": self.restarts,
            "replicas": [r.health() for r in self.replicas],
        }
        if self.family is not None:
            body.update(self.family)
        if self.precision is not None:  # (a loaded model's: fp8, bf16, ...)
            body["precision"] = self.precision
        if self.family is not None:  # (a diffusion stage's step cache; null: off)
            body["cache"] = self.cache
        if self.family is not None or self.offload != "none":  # (its replicas say the rest)
            body["offload"] = self.offload
        if self.restart_error:
            body["restart_error"] = self.restart_error
        return body


@dataclass(frozen=True)
class EngineSnapshot:
    stages: tuple[StageView, ...]
    dead: ErrorInfo | None = None  # set once the engine is dead, for good

    def of(self, pipeline: str) -> tuple[StageView, ...]:
        return tuple(s for s in self.stages if s.pipeline == pipeline)


def work_units(params: GenerationParams, stages: Sequence[StageView]) -> tuple[float, ...]:
    """A request's work at each stage of its pipeline."""
    return tuple(cost.work_units(params, s.default_steps, s.text) for s in stages)


def drain_seconds(units: Sequence[float], stages: Sequence[StageView]) -> float | None:
    """How long the pipeline's stages take for `units` of work each, working side by side: the
    slowest stage's time (None while no stage has been measured)."""
    times = [u * s.rate for u, s in zip(units, stages, strict=True) if s.rate is not None]
    return max(times) if times else None


def take(pools: Iterable[StagePool], dead: ErrorInfo | None) -> EngineSnapshot:
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
                text=pool.text,
                default_steps=pool.default_steps,
                rate=pool.parallel_rate(),
                replicas=tuple(_replica_view(pool, r) for r in replicas),
                family=pool.family,
                precision=pool.precision,
                cache=describe_cache(pool.config),
                offload=pool.config.offload,
            )
        )
    return EngineSnapshot(tuple(views), dead)


def _replica_view(pool: StagePool, replica: Replica) -> ReplicaView:
    if replica.live:
        state = "ready"
    elif replica.stall is not None:  # past its bound: killed, its restart follows its death
        state = "stalled"
    elif replica.restarting:
        state = "restarting"
    else:
        state = "dead" if pool.started else "starting"
    pids = tuple(replica.workers.pids) if replica.live else ()
    return ReplicaView(
        replica.index,
        replica.device,
        state,
        replica.gpu_memory,
        pids,
        replica.start,
        replica.restart_seconds,
        replica.offload,
    )
