"""The diffusion stage's side of our own denoising loop (stages/diffusion/step.py): a batch's rows,
text and noise in, per-request progress and previews out, the latents to the deferred decode;
and the compile warm-up through the same path. A mixin of `DiffusionStage`, whose load sets
what it uses (`denoise`, `adapter`, `probe`, `tracer`, the defaults)."""

from __future__ import annotations

import functools

import torch

from vllm_omni_like.models.adapter import Guidance
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.diffusion.acceleration import guided_rows
from vllm_omni_like.stages.diffusion.prompt_embeds import random_prompt_embeds
from vllm_omni_like.stages.diffusion.runtime import DiffusionState
from vllm_omni_like.stages.diffusion.step import Text
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.wire import StageRequest


class OwnLoop(DiffusionState):
    """Runs a batch through our own loop."""

    def _warm_up_own(self, rows: int, width: int, height: int) -> int:
        """A batch of `rows` for each of the adapter's warm-up prompts (one a text shape its
        denoiser sees), without guidance and with it where that makes other model rows;
        returns how many ran."""
        frames = self.default_frames if self.is_video else None
        mode = self.family.modes[0]
        for guidance in self._warm_up_guidance(rows):
            params = GenerationParams(
                width=width,
                height=height,
                num_inference_steps=2,
                seed=0,
                num_frames=frames,
                guidance_scale=guidance,
            )
            for prompt in self._warm_up_prompts:
                batch = [StageRequest(f"warm-up-{i}", prompt, params, mode) for i in range(rows)]
                self.begin(batch, StageControl(FaultInjector((), self.name))).finish(batch)
        return len(self._warm_up_prompts) * len(self._warm_up_guidance(rows))

    def _warm_up_guidance(self, rows: int) -> tuple[float | None, ...]:
        """The scales a bucket of `rows` images is warmed up at: one without guidance (one model
        row an image) and one with it, unless its model rows are another bucket's already; a
        family whose guidance is embedded or absent: its default (one model row either way)."""
        adapter = self.adapter
        if adapter.guidance in (Guidance.DISTILLED, Guidance.NONE):
            return (None,)
        plain = adapter.cfg_above  # (at or under it: no negative branch)
        guided = max(self.default_guidance, plain + 1.0)
        if guided_rows(adapter, self.config.batched_cfg) * rows in self.buckets:
            return (plain,)
        return (plain, guided)

    @functools.cached_property
    def _warm_up_prompts(self) -> tuple[str, ...]:
        with torch.inference_mode():  # (the adapter counts tokens with its text encoder)
            return self.adapter.warm_up_prompts(self.device)

    def _denoise_own(
        self, batch: list[StageRequest], control: StageControl
    ) -> tuple[torch.Tensor, list[int], int]:
        """The batch's latents, each row's seed, and a video's frames (0 for images): a running
        set that nothing joins (running_set.py), stepped until every live row ended."""
        from vllm_omni_like.stages.diffusion.running_set import OwnLoopSet

        rowset = OwnLoopSet(self)
        try:
            rowset.join(batch, control)  # (its first join opens the timeline's batch)
            while rowset.step(control):
                pass
        except BaseException as failure:
            rowset.drained(failure)
            raise
        rowset.drained()  # the loop ends when its steps do; the timeline is written
        control.saw_model_batch(self.probe.max_seen)
        rows = rowset.set.rows
        assert rowset.set.latents is not None
        return rowset.set.latents, [r.seed for r in rows], rowset.frames

    def _embed(self, texts: list[str | None]) -> Text:
        """The batch's text conditioning: the text encoders', or a dummy's seeded random
        embeddings (None: a negative prompt not given)."""
        if self.embed_shape is not None:
            seq_len, dim = self.embed_shape
            given = [t or "" for t in texts]
            return random_prompt_embeds(given, seq_len, dim, self.denoiser_dtype, self.device)
        max_length = self.tokenizer.model_max_length if self.tokenizer is not None else 512
        return self.adapter.encode_text(texts, self.device, max_length)
