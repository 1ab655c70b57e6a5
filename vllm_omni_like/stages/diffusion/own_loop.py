"""The diffusion stage's side of our own denoising loop (stages/diffusion/step.py): a batch through
a running set that nothing joins (running_set.py), the latents to the deferred decode; and the
compile warm-up through the same path. It receives the stage's runtime (runtime.py)."""

from __future__ import annotations

import functools

import numpy as np
import torch

from vllm_omni_like.models.adapter import Guidance
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.base import Deferred, StageControl
from vllm_omni_like.stages.diffusion.running_set import OwnLoopSet
from vllm_omni_like.stages.diffusion.runtime import DiffusionRuntime
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.wire import Mode, StageRequest


class OwnLoop:
    """Runs a batch through our own loop."""

    def __init__(self, runtime: DiffusionRuntime) -> None:
        self.runtime = runtime

    def begin(self, batch: list[StageRequest], control: StageControl) -> Deferred:
        """The batch's steps; the returned part decodes its latents."""
        rt = self.runtime
        media, seeds, frames = self._denoise(batch, control)
        return rt.defer(batch, media, seeds, frames, rt.adapter.decoder(rt.pipe))

    def warm_up(self, rows: int, width: int, height: int) -> int:
        """A batch of `rows` for each of the adapter's warm-up prompts (one a text shape its
        denoiser sees; a group's prompts taken by the rows in turn), without guidance and with
        it; returns how many ran. A family that only starts from an image starts from a blank
        upload of the size (an upload of another aspect may fit to another sequence length: a
        shape of its own); a model that inpaints only (a 9-channel UNet), with a mask of it all."""
        rt = self.runtime
        frames = rt.defaults.frames if rt.is_video else None
        mode = next(iter(rt.loops))  # (the model's first: `registry.model_modes`)
        images = [np.zeros((height, width, 3), np.uint8)] if rt.limits.needs_image else []
        mask = np.full((height, width), 255, np.uint8) if mode == Mode.INPAINT else None
        mode = Mode.EDIT if mask is not None else mode  # (an inpainting edit is sent as one)
        ran = 0
        for guidance in self._warm_up_guidance():
            params = GenerationParams(
                width=width,
                height=height,
                num_inference_steps=2,
                seed=0,
                num_frames=frames,
                guidance_scale=guidance,
            )
            batches = {_rows_of(group, rows): None for group in self._warm_up_prompts}
            for texts in batches:  # (a group wider than the batch: as its first prompt alone)
                batch = [  # (an image's PNG rows filtered on the device, as a request's)
                    StageRequest(
                        f"warm-up-{i}", t, params, mode, images, mask=mask, encodes_png=not frames
                    )
                    for i, t in enumerate(texts)
                ]
                self.begin(batch, StageControl(FaultInjector((), rt.name))).finish(batch)
                ran += 1
        return ran

    def _warm_up_guidance(self) -> tuple[float | None, ...]:
        """The scales each bucket is warmed up at: one without guidance (one model row an image)
        and one with it (its negative branch's rows; where a prompt and its negative differ in
        length, as Z-Image's and Qwen-Image's do, a masked forward of its own even where another
        bucket has as many model rows); a family whose guidance is embedded or absent: its
        default (one model row either way)."""
        rt = self.runtime
        adapter = rt.adapter
        if adapter.guidance in (Guidance.DISTILLED, Guidance.NONE):
            return (None,)
        plain = adapter.cfg_above  # (at or under it: no negative branch)
        return (plain, max(rt.defaults.guidance, plain + 1.0))

    @functools.cached_property
    def _warm_up_prompts(self) -> tuple[str | tuple[str, ...], ...]:
        with torch.inference_mode():  # (the adapter counts tokens with its text encoder)
            return self.runtime.adapter.warm_up_prompts(self.runtime.device)

    def _denoise(
        self, batch: list[StageRequest], control: StageControl
    ) -> tuple[torch.Tensor, list[int], int]:
        """The batch's latents, each row's seed, and a video's frames (0 for images): a running
        set that nothing joins (running_set.py), stepped until every live row ended."""
        rowset = OwnLoopSet(self.runtime)
        try:
            rowset.join(batch, control)  # (its first join opens the timeline's batch)
            while rowset.step(control):
                pass
        except BaseException as failure:
            rowset.drained(failure)
            raise
        finally:
            rowset.set.let_go()  # (its rows' LoRA slots: the set is not kept)
        rowset.drained()  # the loop ends when its steps do; the timeline is written
        control.saw_model_batch(self.runtime.probe.max_seen)
        rows = rowset.set.rows
        assert rowset.set.latents is not None
        return rowset.set.latents, [r.seed for r in rows], rowset.frames


def _rows_of(group: str | tuple[str, ...], rows: int) -> tuple[str, ...]:
    """The prompts of a warm-up batch of `rows`: the group's, in turn."""
    texts = (group,) if isinstance(group, str) else group
    return tuple(texts[i % len(texts)] for i in range(rows))
