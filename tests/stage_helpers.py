"""Stage classes used by tests through the 'module:Class' stage kind (imported in workers)."""

from __future__ import annotations

from vllm_omni_like.errors import FatalStageError
from vllm_omni_like.stages.base import Deferred, StageControl
from vllm_omni_like.stages.null import NullStage
from vllm_omni_like.wire import StageRequest


class DeviceErrorStage(NullStage):
    """Fails like a broken GPU when a prompt says 'device-error', like a CFG-parallel rank whose
    peer is gone on 'link-broken'."""

    def begin(self, batch: list[StageRequest], control: StageControl) -> Deferred:
        if any("device-error" in r.prompt for r in batch):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if any("link-broken" in r.prompt for r in batch):
            raise FatalStageError("rank 0: sending to rank 1 failed: Connection reset by peer")
        return super().begin(batch, control)


class CountingStage(NullStage):
    """Counts begin calls (for bisection cost) and fails batches holding a '@bad' prompt."""

    calls: list[int] = []

    def begin(self, batch: list[StageRequest], control: StageControl) -> Deferred:
        type(self).calls.append(len(batch))
        if any("@bad" in r.prompt for r in batch):
            raise ValueError("bad input in batch")
        if any("@oom" in r.prompt for r in batch):
            raise MemoryError("simulated out of memory")
        return super().begin(batch, control)


class FinisherCrashStage(NullStage):
    """Its deferred finish dies outright (not a request error) for a '@crash-finisher' prompt."""

    def begin(self, batch: list[StageRequest], control: StageControl) -> Deferred:
        part = super().begin(batch, control)

        def finish(requests: list[StageRequest]):
            if any("@crash-finisher" in r.prompt for r in requests):
                raise SystemExit("the finisher thread is gone")
            return part.finish(requests)

        return Deferred(part.requests, finish)
