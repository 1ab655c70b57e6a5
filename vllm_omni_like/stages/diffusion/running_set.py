"""The diffusion stage's running set: requests join our own loop at a step boundary.

The running-set contract of stages/base.py `RowStepper`: groups of requests of one shape group
join our own loop at a step boundary, each row steps with its own schedule, and a request leaves
when its rows have ended, its decode deferred as a whole batch's is. A whole batch through our
own loop is a set that nothing joins (own_loop.py), so both run the same maths.

Rows that end are held for their **decode group**: their latents decode together once
`decode_group_rows` of them have ended, or the first of them ended `decode_group_ms` ago, or
the set drained (a decode of 8 rows costs far less than 8 of one). A held request is still in
the set (`requests`) until its group is handed over, so its group's end follows its result."""

from __future__ import annotations

import time

import torch

from vllm_omni_like.stages.base import Deferred, RowStepper, StageControl
from vllm_omni_like.stages.diffusion.row_tensors import text_dtype
from vllm_omni_like.stages.diffusion.rows import DenoiseSet, Left
from vllm_omni_like.stages.diffusion.runtime import DiffusionRuntime
from vllm_omni_like.wire import StageRequest

_now = time.monotonic  # (a test's fake clock replaces it)


class OwnLoopSet(RowStepper):
    def __init__(self, runtime: DiffusionRuntime) -> None:
        self.runtime = runtime
        self.set = DenoiseSet(runtime.denoise)
        self.frames = 0
        # from the first join until the set drains: one batch of the stage's timeline (shared
        # with the other lanes of the worker's running set)
        self._traced = False
        self.held: list[Left] = []  # ended rows waiting for their decode group
        self.held_since = 0.0  # when the first of them ended
        self.dropped: set[str] = set()  # held requests that failed since (not decoded)

    @property
    def requests(self) -> list[StageRequest]:
        held = [r for left in self.held for r in left.requests if r.request_id not in self.dropped]
        return self.set.requests + held

    @property
    def stepping(self) -> list[StageRequest]:
        return self.set.requests  # (not the held ones: their rows ended)

    def join(self, batch: list[StageRequest], control: StageControl) -> None:
        rt, d, p = self.runtime, self.runtime.defaults, batch[0].params
        frames = (p.num_frames or d.frames) if rt.is_video else 1
        width, height = rt.size_of(batch[0])
        opened = self.set.empty and not self._traced
        if opened:  # the set's timeline begins before its first rows' text encoders
            self._traced = True
            rt.tracer.open_shared()
        try:
            with torch.inference_mode():
                rows, embeds = rt.denoise.rows(batch, rt.settings(), (width, height))
                shape = rt.adapter.latent_shape(len(rows), width, height, frames)
                dtype = rt.adapter.latent_dtype(text_dtype(embeds))
                latents = rt.denoise.noise(rows, shape, dtype)
                latents, conditioning = rt.denoise.conditions(rows, latents)
        except BaseException as exc:
            if opened:
                self.drained(exc)
            raise
        rt.tracer.mark("joined")  # (the next step's time is the step's alone)
        if self.set.empty:
            self.frames = frames if rt.is_video else 0
            rt.probe.reset()
        self.set.join(rows, embeds, latents, conditioning)

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
            rt, previews = self.runtime, None
            if want:
                assert self.set.latents is not None
                first = self.set.first_rows()
                previews = rt.preview_images(rt.pipe, want, first, self.set.latents)
        step = max(at for at, _ in progress.values())
        total = max(of for _, of in progress.values())
        stepped = [r for r in requests if r.request_id in progress]
        control.saw_model_batch(rt.probe.max_seen)
        control.step(stepped, step, total, previews, progress, fire=False)
        rt.tracer.mark("step", len(stepped))
        return True

    def leave(self, control: StageControl) -> Deferred | None:
        live = {r.request_id for r in control.live(self.set.requests)}
        left = self.set.leave(live)
        if left is not None:
            if not self.held:
                self.held_since = _now()
            self.held.append(left)
        part = self._decode_group(control) if self.held else None
        if self.set.empty:
            self.drained()
        return part

    def _decode_group(self, control: StageControl) -> Deferred | None:
        """The held rows as one decode, once their group is complete (see above)."""
        config = self.runtime.config
        rows = sum(len(left.seeds) for left in self.held)
        waited = (_now() - self.held_since) * 1000.0
        if not (
            self.set.empty or rows >= config.decode_group_rows or waited >= config.decode_group_ms
        ):
            return None
        held, dropped, self.held, self.dropped = self.held, self.dropped, [], set()
        everyone = [r for h in held for r in h.requests]  # (in the latents' row order)
        requests = [r for r in control.live(everyone) if r.request_id not in dropped]
        if not requests:  # all aborted or failed while held
            return None
        with torch.inference_mode():
            latents = held[0].latents if len(held) == 1 else torch.cat([h.latents for h in held])
        seeds = [seed for h in held for seed in h.seeds]
        rt = self.runtime
        part = rt.defer(everyone, latents, seeds, self.frames, rt.adapter.decoder(rt.pipe))
        return Deferred(requests, part.finish)

    def drained(self, failure: BaseException | None = None) -> None:
        """The set is empty: its steps end when the device's do (the denoise phase is device
        time, as a whole batch's), and its timeline is written - not after a `failure` (its
        device may be gone)."""
        if not self._traced:
            return
        self._traced = False
        rt = self.runtime
        if failure is None and rt.tracer.sharing == 1:  # the last lane: wait for the device
            if rt.device.type == "cuda":
                torch.cuda.current_stream(rt.device).synchronize()
            rt.tracer.mark("synced")
        rt.tracer.close_shared(failure)

    def drop(self, request_ids: set[str]) -> None:
        self.set.remove(request_ids)
        self.dropped |= {r.request_id for h in self.held for r in h.requests} & request_ids
        if self.set.empty and not self.held:  # (held rows: the next leave hands them over)
            self.drained()
