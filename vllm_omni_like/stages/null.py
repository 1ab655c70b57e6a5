"""A stage that never imports torch: steps and delays from the request, deterministic output."""

from __future__ import annotations

import hashlib
import re
import time

import numpy as np

from vllm_omni_like.cost import step_units
from vllm_omni_like.errors import InvalidRequestError
from vllm_omni_like.outputs import ImagePayload, StageOutput, VideoPayload
from vllm_omni_like.stage_options import NullOptions
from vllm_omni_like.stages.base import Deferred, Stage, StageControl
from vllm_omni_like.wire import StageRequest

MAX_SIDE = 2048


def _prompt_delay(prompt: str) -> float:
    """'@delay=0.05' in a prompt sets the per-step delay (for tests over HTTP)."""
    match = re.search(r"@delay=([0-9.]+)", prompt)
    return float(match.group(1)) if match else 0.0


def _digest(seed: int | None, prompt: str, index: int) -> int:
    data = f"{seed}|{prompt}|{index}".encode()
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


class NullStage(Stage):
    """Control-plane stand-in for an LLM (output=text) or a diffusion model (image/video)."""

    options_type = NullOptions

    def load(self, device: str) -> None:
        opts = self.options
        self.output_kind, self.default_steps = opts.output, opts.steps
        self.decode_delay = opts.decode_delay
        self.step_s_per_munit = opts.step_s_per_munit
        self.device = device

    def validate(self, request: StageRequest) -> None:
        p = request.params
        for side, value in (("width", p.width), ("height", p.height)):
            if value is not None and not 0 < value <= MAX_SIDE:
                raise InvalidRequestError(
                    f"{side} {value} is outside 1..{MAX_SIDE}", stage=self.name, param="size"
                )

    def begin(self, batch: list[StageRequest], control: StageControl) -> Deferred:
        control.saw_model_batch(len(batch))
        steps = batch[0].params.num_inference_steps or self.default_steps
        delay = max(batch[0].params.step_delay, max(_prompt_delay(r.prompt) for r in batch))
        text = self.output_kind == "text"
        delay += self.step_s_per_munit * sum(step_units(r.params, text) for r in batch) / 1e6
        for i in range(steps):
            if delay > 0:
                time.sleep(delay)
            previews = {
                r.request_id: self._preview(r, i + 1, steps)
                for r in batch
                if self.output_kind == "image" and control.wants_preview(r, i + 1, steps)
            }
            control.step(batch, i + 1, steps, previews)
        return Deferred(control.live(batch), lambda live: self._finish(live, control))

    def _finish(self, live: list[StageRequest], control: StageControl) -> list[StageOutput]:
        """The 'decode' of an image/video stand-in: `decode_delay` seconds (option) for the whole
        call; then the outputs."""
        if self.decode_delay > 0 and self.output_kind != "text":
            time.sleep(self.decode_delay)
        return [self._output(r, control.steps_run.get(r.request_id, 0)) for r in live]

    def _preview(self, r: StageRequest, step: int, total: int) -> np.ndarray:
        """What the final image looks like so far: a blend from grey towards it."""
        final = self._output(r, 0).images[0].pixels.astype(np.float32)
        return (128 + (final - 128) * step / total).astype(np.uint8)

    def _output(self, r: StageRequest, steps_run: int) -> StageOutput:
        out = StageOutput(request_id=r.request_id, stage=self.name, steps_run=steps_run)
        p = r.params
        if self.output_kind == "text":
            out.text = f"{r.prompt} (rewritten #{_digest(p.seed, r.prompt, 0) % 10_000:04d})"
            return out
        h, w = p.height or 64, p.width or 64
        if self.output_kind == "video":
            rng = np.random.default_rng(_digest(p.seed, r.prompt, 0))
            frames = rng.integers(0, 256, size=(p.num_frames or 5, h, w, 3), dtype=np.uint8)
            out.video = VideoPayload(frames=frames, fps=p.fps or 8, seed=p.seed)
            return out
        for i in range(p.n):
            seed = None if p.seed is None else p.seed + i
            rng = np.random.default_rng(_digest(seed, r.prompt, i))
            pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
            out.images.append(ImagePayload(pixels=pixels, seed=seed))
        return out
