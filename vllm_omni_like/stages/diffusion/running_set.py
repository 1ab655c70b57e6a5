"""The diffusion stage's running set: requests join our own loop at a step boundary.

The running-set contract of stages/base.py `RowStepper`: groups of requests of one shape group
join our own loop at a step boundary, each row steps with its own schedule, and a request leaves
when its rows have ended, its decode deferred as a whole batch's is. A whole batch through our
own loop is a set that nothing joins (own_loop.py), so both run the same maths.

Rows that end are held for their **decode group**: their latents decode together once
`decode_group_rows` of them have ended, or the first of them ended `decode_group_ms` ago, or
the set drained (a decode of 8 rows costs far less than 8 of one). A held request is still in
the set (`requests`) until its group is handed over, so its group's end follows its result.

A request whose LoRA adapter files are still being read (lora_reads.py: its validation started
the reads, on their own thread) waits in the set, `pending`, without stepping: it joins at the
first step boundary after its reads are done, so the rows already in the set keep stepping
meanwhile; a file that cannot be used fails that request alone (its 400, handed over as a
result at that boundary)."""

from __future__ import annotations

import time

import torch

from vllm_omni_like.outputs import StageOutput
from vllm_omni_like.stages.base import Deferred, RowStepper, StageControl
from vllm_omni_like.stages.diffusion.row_tensors import text_dtype
from vllm_omni_like.stages.diffusion.rows import DenoiseSet, Left
from vllm_omni_like.stages.diffusion.runtime import DiffusionRuntime
from vllm_omni_like.stages.isolation import bisect_isolated
from vllm_omni_like.wire import StageRequest

_now = time.monotonic  # (a test's fake clock replaces it)
READ_WAIT_S = 0.05  # a set of pending requests alone waits this long for a read, then looks again


class OwnLoopSet(RowStepper):
    def __init__(self, runtime: DiffusionRuntime, defer_reads: bool = False) -> None:
        self.runtime = runtime
        # requests waiting for their LoRA files' reads (`defer_reads`: a running set's; a
        # whole batch waits for them at its join, with nothing beside it)
        self.defer_reads = defer_reads and runtime.denoise.loras is not None
        self.pending: list[StageRequest] = []
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
        return self.set.requests + held + self.pending

    @property
    def stepping(self) -> list[StageRequest]:
        return self.set.requests  # (not the held ones: their rows ended)

    def join(self, batch: list[StageRequest], control: StageControl) -> None:
        pool = self.runtime.denoise.loras
        if self.defer_reads and pool is not None:
            waiting = [r for r in batch if not pool.ready(r.params.loras)]
            if waiting:
                ready = [r for r in batch if r not in waiting]
                if ready:
                    self._join(ready, control)
                self.pending += waiting  # (after the join: a join that raises adds nothing)
                return
        self._join(batch, control)

    def _join(self, batch: list[StageRequest], control: StageControl) -> None:
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
        pool = self.runtime.denoise.loras
        if self.set.empty:  # (pending requests alone: nothing steps while their files are read)
            if self.pending and pool is not None:
                pool.wait(tuple(ref for r in self.pending for ref in r.params.loras), READ_WAIT_S)
            return False
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
        failed = self._join_read(control)
        part = self._decode_group(control) if self.held else None
        if self.set.empty:
            self.drained()
        if failed:  # (their errors, handed over beside what ended at this boundary)
            errors = Deferred.done([r for r, _ in failed], [out for _, out in failed])
            if part is None:
                return errors
            both = part.requests + errors.requests

            def finish(requests: list[StageRequest]) -> list[StageOutput]:
                mine = {r.request_id for r in errors.requests}
                theirs = [r for r in requests if r.request_id not in mine]
                outs = part.finish(theirs) if theirs else []
                return outs + errors.finish([r for r in requests if r.request_id in mine])

            return Deferred(both, finish)
        return part

    def _join_read(self, control: StageControl) -> list[tuple[StageRequest, StageOutput]]:
        """The pending requests whose reads are done join now, one at a time (an aborted one
        leaves); those whose join fails (a file that cannot be used: 400 lora_unusable, every
        slot held: 503 lora_pool_full) fail alone: returned with their error outputs."""
        pool = self.runtime.denoise.loras
        if not self.pending or pool is None:
            return []
        live = {r.request_id for r in control.live(self.pending)}
        ready = [r for r in self.pending if r.request_id in live and pool.ready(r.params.loras)]
        self.pending = [r for r in self.pending if r.request_id in live and r not in ready]
        failed: list[tuple[StageRequest, StageOutput]] = []

        def join(live: list[StageRequest]) -> list[StageOutput]:
            self._join(live, control)
            return []

        for request in ready:  # (alone: its failure is its own, classified as a culprit's)
            outs: list[StageOutput] = []
            bisect_isolated(self.runtime.name, [request], control, join, outs.append)
            failed += [(request, out) for out in outs]
        return failed

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
        self.pending = [r for r in self.pending if r.request_id not in request_ids]
        self.dropped |= {r.request_id for h in self.held for r in h.requests} & request_ids
        if self.set.empty and not self.held:  # (held rows: the next leave hands them over)
            self.drained()
