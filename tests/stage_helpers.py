"""Stage classes used by tests through the 'module:Class' stage kind (imported in workers)."""

from __future__ import annotations

import gc
import time

from vllm_omni_like.errors import FatalStageError
from vllm_omni_like.outputs import StageOutput
from vllm_omni_like.stages.base import Deferred, RowStepper, StageControl, run_whole
from vllm_omni_like.stages.null import NullStage, _digest, _prompt_delay
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


class TokenRows(RowStepper):
    """Token-like rows: each request wants `num_inference_steps` tokens (a token a step, each
    derived from its seed, prompt and position), joins at any step and leaves when it has them
    all; '@delay=S' sleeps S seconds a step. The running-set contract is not diffusion-only."""

    def __init__(self, stage: TokenStepStage) -> None:
        self.stage = stage
        self.rows: dict[str, tuple[StageRequest, list[str]]] = {}

    @property
    def requests(self) -> list[StageRequest]:
        return [request for request, _ in self.rows.values()]

    def join(self, batch: list[StageRequest], control: StageControl) -> None:
        for r in batch:
            self.rows[r.request_id] = (r, [])

    def _wants(self, request: StageRequest) -> int:
        return request.params.num_inference_steps or self.stage.default_steps

    def step(self, control: StageControl, only: set[str] | None = None) -> bool:
        live = [r for r in control.live(self.requests) if only is None or r.request_id in only]
        stepping = [r for r in live if len(self.rows[r.request_id][1]) < self._wants(r)]
        if not stepping:
            return False
        delay = max(_prompt_delay(r.prompt) for r in stepping)
        if delay:
            time.sleep(delay)
        control.faults.fire("step", stepping)  # before anything is committed
        for r in stepping:
            tokens = self.rows[r.request_id][1]
            tokens.append(f"t{_digest(r.params.seed, r.prompt, len(tokens)) % 1000}")
        progress = {
            r.request_id: (len(self.rows[r.request_id][1]), self._wants(r)) for r in stepping
        }
        step = max(at for at, _ in progress.values())
        total = max(of for _, of in progress.values())
        control.step(stepping, step, total, None, progress, fire=False)
        return True

    def leave(self, control: StageControl) -> Deferred | None:
        live = {r.request_id for r in control.live(self.requests)}
        for rid in [rid for rid in self.rows if rid not in live]:
            del self.rows[rid]  # aborted: dropped
        ended = [r for r, tokens in self.rows.values() if len(tokens) >= self._wants(r)]
        if not ended:
            return None
        outputs = {}
        for r in ended:
            _, tokens = self.rows.pop(r.request_id)
            outputs[r.request_id] = StageOutput(
                r.request_id, self.stage.name, text=" ".join(tokens)
            )
        return Deferred(ended, lambda requests: [outputs[r.request_id] for r in requests])

    def drop(self, request_ids: set[str]) -> None:
        for rid in request_ids:
            self.rows.pop(rid, None)


class TokenStepStage(NullStage):
    """A text stage (option output=text) whose rows, of every mode, run as a running set
    (`TokenRows`); an image or video one runs whole batches as a NullStage."""

    MODES = ("text", "text2img", "edit", "text2video")

    def stepped_modes(self) -> tuple[str, ...]:
        return self.MODES if self.output_kind == "text" else ()

    def stepper(self, mode: str) -> RowStepper | None:
        return TokenRows(self) if mode in self.stepped_modes() else None

    def begin(self, batch: list[StageRequest], control: StageControl) -> Deferred:
        """A text batch run whole (`--batch-level request`): a set that nothing joins."""
        if self.output_kind != "text":
            return super().begin(batch, control)
        return run_whole(TokenRows(self), batch, control)


class LaneStepStage(TokenStepStage):
    """An image stand-in with both kinds of group: its text2img rows step as a running set
    (`TokenRows`, a lane a size), its edits run as whole batches (`NullStage`)."""

    def stepped_modes(self) -> tuple[str, ...]:
        return ("text2img",)


class HeapStage(NullStage):
    """Keeps 100,000 objects from its load; its text says how many objects the collector had
    frozen when the request ran (`gc.get_freeze_count()`)."""

    def load(self, device: str) -> None:
        super().load(device)
        self.kept = [{"i": i} for i in range(100_000)]

    def _output(self, r: StageRequest, steps_run: int) -> StageOutput:
        return StageOutput(r.request_id, self.name, text=str(gc.get_freeze_count()))
