"""The diffusion stage's side of our own denoising loop (stages/denoise.py): a batch's rows,
text and noise in, per-request progress and previews out, the latents to the deferred decode;
and the compile warm-up through the same path. A mixin of `DiffusionStage`, whose load sets
what it uses (`denoise`, `adapter`, `probe`, `tracer`, the defaults)."""

from __future__ import annotations

import torch

from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.denoise import Settings, Text, text_dtype
from vllm_omni_like.stages.diffusion_state import DiffusionState
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.stages.prompt_embeds import random_prompt_embeds
from vllm_omni_like.stages.prompt_length import truncate_prompt
from vllm_omni_like.wire import StageRequest


class OwnLoop(DiffusionState):
    """Runs a batch through our own loop."""

    def _warm_up_own(self, rows: int, width: int, height: int) -> None:
        frames = self.default_frames if self.is_video else None
        params = GenerationParams(
            width=width, height=height, num_inference_steps=2, seed=0, num_frames=frames
        )
        mode = self.family.modes[0]
        batch = [StageRequest(f"warm-up-{i}", "warm-up", params, mode) for i in range(rows)]
        self.begin(batch, StageControl(FaultInjector((), self.name))).finish(batch)

    def _denoise_own(
        self, batch: list[StageRequest], control: StageControl
    ) -> tuple[torch.Tensor, list[int], int]:
        """The batch's latents, each row's seed, and a video's frames (0 for images)."""
        p = batch[0].params
        settings = Settings(self.default_steps, self.default_guidance, self._rows, self._prompt)
        frames = (p.num_frames or self.default_frames) if self.is_video else 1
        width, height = p.width or self.default_width, p.height or self.default_height
        self.probe.reset()
        with self.tracer.batch(), torch.inference_mode():
            rows, embeds = self.denoise.rows(batch, settings)
            shape = self.adapter.latent_shape(len(rows), width, height, frames)
            dtype = self.adapter.latent_dtype(text_dtype(embeds))
            latents = self.denoise.noise(rows, shape, dtype)
            first: dict[str, int] = {}
            for i, row in enumerate(rows):
                first.setdefault(row.request.request_id, i)

            def on_step(latents: torch.Tensor, progress: dict[str, tuple[int, int]]) -> None:
                want = [
                    r
                    for r in batch
                    if r.request_id in progress
                    and control.wants_preview(r, *progress[r.request_id])
                ]
                previews = self._preview_images(self.pipe, want, first, latents) if want else None
                step = max(at for at, _ in progress.values())
                total = max(of for _, of in progress.values())
                control.step(batch, step, total, previews, progress)

            latents = self.denoise.run(rows, embeds, latents, control, batch, on_step)
            if self.device.type == "cuda":  # the loop ends when its steps do
                torch.cuda.current_stream(self.device).synchronize()
            self.tracer.mark("synced")
        control.saw_model_batch(self.probe.max_seen)
        return latents, [r.seed for r in rows], frames if self.is_video else 0

    def _prompt(self, request: StageRequest) -> str:
        if request.truncate_prompt and self.tokenizer is not None:
            return truncate_prompt(self.tokenizer, request.prompt, self.name)
        return request.prompt

    def _embed(self, texts: list[str | None]) -> Text:
        """The batch's text conditioning: the text encoders', or a dummy's seeded random
        embeddings (None: a negative prompt not given)."""
        if self.embed_shape is not None:
            seq_len, dim = self.embed_shape
            given = [t or "" for t in texts]
            return random_prompt_embeds(given, seq_len, dim, self.denoiser_dtype, self.device)
        max_length = self.tokenizer.model_max_length if self.tokenizer is not None else 512
        return self.adapter.encode_text(texts, self.device, max_length)
