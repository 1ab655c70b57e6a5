"""The diffusion stage's running set (the running-set contract of stages/base.py `RowStepper`):
groups of requests of one shape group join our own loop at a step boundary, each row steps
with its own schedule, and a request leaves when its rows have ended, its decode deferred as a
whole batch's is. A whole batch through our own loop is a set that nothing joins
(own_loop.py), so both run the same maths."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from vllm_omni_like.stages.base import Deferred, RowStepper, StageControl
from vllm_omni_like.stages.denoise import Settings, text_dtype
from vllm_omni_like.stages.denoise_set import DenoiseSet
from vllm_omni_like.stages.diffusion_state import DiffusionState
from vllm_omni_like.wire import StageRequest


class OwnLoopSet(RowStepper):
    def __init__(self, stage: DiffusionState) -> None:
        self.stage = stage
        self.set = DenoiseSet(stage.denoise)
        self.key: tuple[Any, ...] | None = None  # the shape group of the rows in the set
        self.frames = 0
        # from the first join until the set drains: one batch of the stage's timeline
        self._traced: contextlib.ExitStack | None = None

    @property
    def requests(self) -> list[StageRequest]:
        return self.set.requests

    def accepts(self, request: StageRequest) -> bool:
        return self.set.empty or request.batch_key(frozenset(self.stage.own)) == self.key

    def join(self, batch: list[StageRequest], control: StageControl) -> None:
        stage, p = self.stage, batch[0].params
        settings = Settings(stage.default_steps, stage.default_guidance, stage._rows, stage._prompt)
        frames = (p.num_frames or stage.default_frames) if stage.is_video else 1
        width, height = p.width or stage.default_width, p.height or stage.default_height
        with torch.inference_mode():
            rows, embeds = stage.denoise.rows(batch, settings)
            shape = stage.adapter.latent_shape(len(rows), width, height, frames)
            dtype = stage.adapter.latent_dtype(text_dtype(embeds))
            latents = stage.denoise.noise(rows, shape, dtype)
        if self.set.empty:
            self.key = batch[0].batch_key(frozenset(stage.own))
            self.frames = frames if stage.is_video else 0
            stage.probe.reset()
            if self._traced is None:
                self._traced = contextlib.ExitStack()
                self._traced.enter_context(stage.tracer.batch())
        self.set.join(rows, embeds, latents)

    def step(self, control: StageControl, only: set[str] | None = None) -> bool:
        requests = self.set.requests
        live = {r.request_id for r in control.live(requests)}

        def check(stepped: list[StageRequest]) -> None:
            control.faults.fire("step", stepped)

        with torch.inference_mode():
            progress = self.set.step(live, check, only)
            if not progress:
                return False
            want = [
                r
                for r in requests
                if r.request_id in progress and control.wants_preview(r, *progress[r.request_id])
            ]
            stage, previews = self.stage, None
            if want:
                assert self.set.latents is not None
                first = self.set.first_rows()
                previews = stage._preview_images(stage.pipe, want, first, self.set.latents)
        step = max(at for at, _ in progress.values())
        total = max(of for _, of in progress.values())
        stepped = [r for r in requests if r.request_id in progress]
        control.saw_model_batch(stage.probe.max_seen)
        control.step(stepped, step, total, previews, progress, fire=False)
        self.stage.tracer.mark("step")
        return True

    def leave(self, control: StageControl) -> Deferred | None:
        live = {r.request_id for r in control.live(self.set.requests)}
        left = self.set.leave(live)
        part = None
        if left is not None:
            stage = self.stage
            decoder = stage.adapter.decoder(stage.pipe)
            part = stage.defer(left.requests, left.latents, left.seeds, self.frames, decoder)
        if self.set.empty:
            self.drained()
        return part

    def drained(self, failure: BaseException | None = None) -> None:
        """The set is empty: its steps end when the device's do (the denoise phase is device
        time, as a whole batch's), and its timeline is written - not after a `failure` (its
        device may be gone)."""
        self.key = None
        traced, self._traced = self._traced, None
        if traced is None:
            return
        if failure is not None:
            traced.__exit__(type(failure), failure, failure.__traceback__)
            return
        stage = self.stage
        if stage.device.type == "cuda":
            torch.cuda.current_stream(stage.device).synchronize()
        stage.tracer.mark("synced")
        traced.close()

    def drop(self, request_ids: set[str]) -> None:
        self.set.remove(request_ids)
        if self.set.empty:
            self.drained()
