"""The diffusion stage's side of the diffusers pipeline's own call: the modes our loop does not
run (edits; every mode of a generic family or of CFG-parallel ranks). Whole requests batched
together (one step count, guidance and scheduler a batch: the batching key holds them), with
CFG batched or split over ranks by wrapping the denoiser. A mixin of `DiffusionStage`."""

from __future__ import annotations

import random
from typing import Any

import torch

from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.diffusion import acceleration as accel
from vllm_omni_like.stages.diffusion import edits
from vllm_omni_like.stages.diffusion.prompt_embeds import random_prompt_embeds
from vllm_omni_like.stages.diffusion.prompt_length import truncate_prompt
from vllm_omni_like.stages.diffusion.runtime import DiffusionState
from vllm_omni_like.wire import Mode, StageRequest


class PipelineCall(DiffusionState):
    """Runs a batch through the pipeline's `__call__`."""

    def _warm_up_call(self, rows: int, width: int, height: int, mode: str = "") -> None:
        """Two steps of the pipeline's call in `mode` (the family's first by default); a mode
        of `edit_pipes` (an edit, an image-to-video call) starts from a blank image."""
        mode = mode or self.family.modes[0]
        gens = [torch.Generator(device=self.device).manual_seed(0) for _ in range(rows)]
        kwargs = self._call_kwargs(["warm-up"] * rows, [""] * rows, gens, 2, self.default_guidance)
        kwargs.update(width=width, height=height)
        if self.is_video:
            kwargs["num_frames"] = self.default_frames
        pipe = self.pipe
        if mode in self.edit_pipes:
            from PIL import Image

            blank = Image.new("RGB", (width, height))
            pipe = self.edit_pipes[mode]
            # an image-to-video call takes its one first frame; an edit an image a row
            kwargs["image"] = blank if mode == Mode.IMAGE2VIDEO else [blank] * rows
        self._run(pipe, kwargs)

    def _prepare(
        self, batch: list[StageRequest], control: StageControl
    ) -> tuple[Any, dict[str, Any], int, list[int]]:
        """The pipeline and its call for `batch`, the number of real rows and their seeds."""
        first = batch[0]
        p = first.params
        prompts, negatives, generators, seeds = [], [], [], []
        for r in batch:
            base = r.params.seed if r.params.seed is not None else random.randrange(2**31)
            for i in range(self._rows(r)):
                prompts.append(r.prompt)
                negatives.append(r.params.negative_prompt or "")
                seeds.append(base + i)
                generators.append(torch.Generator(device=self.device).manual_seed(base + i))
        if self.tokenizer is not None and any(r.truncate_prompt for r in batch):
            prompts = [truncate_prompt(self.tokenizer, t, self.name) for t in prompts]
        rows = len(prompts)
        # a compiled denoiser runs only the shapes it was warmed up for: pad to the bucket
        for _ in range(accel.bucket_for(rows, self.buckets) - rows):
            prompts.append(prompts[-1])
            negatives.append(negatives[-1])
            generators.append(torch.Generator(device=self.device).manual_seed(0))
        guidance = self.default_guidance if p.guidance_scale is None else p.guidance_scale
        steps = p.num_inference_steps or self.default_steps
        # (one guidance a batch, a family's second scale too: the batching key holds them)
        kwargs = self._call_kwargs(prompts, negatives, generators, steps, guidance, p)
        if self.is_video:
            kwargs["num_frames"] = p.num_frames or self.default_frames
        pipe = self.pipe
        if first.mode == Mode.EDIT:
            pad, multiple = len(prompts) - rows, self.limits.size_multiple
            mode = edits.edit_inputs(batch, kwargs, pad, multiple, self.family.edit_strength)
            pipe = self.edit_pipes[mode]
        elif first.mode == Mode.IMAGE2VIDEO:  # (one request a batch: the batching key)
            size = (p.width or self.default_width, p.height or self.default_height)
            kwargs["image"] = edits.first_frame(first, *size)
            pipe = self.edit_pipes[Mode.IMAGE2VIDEO]
        # the batch's scheduler (one per batch here: the batching key holds it)
        pipe.scheduler = self.adapter.scheduler(p.scheduler) if p.scheduler else self.scheduler
        kwargs.setdefault("height", p.height or self.default_height)
        kwargs.setdefault("width", p.width or self.default_width)
        kwargs["callback_on_step_end"] = self._callback(
            batch, control, (kwargs["width"], kwargs["height"])
        )
        return pipe, kwargs, rows, seeds

    def _denoise(self, pipe: Any, kwargs: dict[str, Any], control: StageControl) -> Any:
        self.probe.reset()
        with self.tracer.batch():
            result = self._run(pipe, kwargs)
            if self.device.type == "cuda":  # no step waits on the device (HostUniPC): the loop
                torch.cuda.current_stream(self.device).synchronize()  # ends when its steps do
            self.tracer.mark("synced")
        control.saw_model_batch(self.probe.max_seen)
        return result

    def _run(self, pipe: Any, kwargs: dict[str, Any]) -> Any:
        """One pipeline call; with CFG, both halves in one forward on a two-call pipeline, or
        on two ranks (CFG-parallel)."""
        if self.cfg is not None and kwargs.get("guidance_scale", 0.0) > 1.0:
            if self.cfg.needs_embeddings and "prompt_embeds" not in kwargs:  # the negative half
                kwargs["prompt_embeds"], kwargs["negative_prompt_embeds"] = (
                    self.adapter.encode_prompt(kwargs, self.device)
                )
            if self.cfg.needs_embeddings:
                for key in ("prompt_embeds", "negative_prompt_embeds"):
                    kwargs[key] = kwargs[key].to(self.denoiser_dtype)  # the pipeline's: no-op
            self.cfg.arm(kwargs)
        try:
            with torch.inference_mode():
                result = pipe(**kwargs)
            if self.cfg is not None:
                self.cfg.settle()
            return result
        finally:
            if self.cfg is not None:
                self.cfg.disarm()

    def _call_kwargs(
        self,
        prompts: list[str],
        negatives: list[str],
        generators: list[torch.Generator],
        steps: int,
        guidance: float,
        params: GenerationParams | None = None,
    ) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "num_inference_steps": steps,
            **self.adapter.guidance_kwargs(guidance, params),
            "output_type": "pt",
            "generator": generators,
        }
        if self.embed_shape is not None:  # no text encoder: seeded random embeddings
            seq_len, dim = self.embed_shape
            dtype, device = self.denoiser_dtype, self.device
            kwargs["prompt_embeds"] = random_prompt_embeds(prompts, seq_len, dim, dtype, device)
            kwargs["negative_prompt_embeds"] = random_prompt_embeds(
                negatives, seq_len, dim, dtype, device
            )
            kwargs["max_sequence_length"] = seq_len
            return kwargs
        kwargs.update(self.adapter.text_kwargs(prompts, negatives, self.tokenizer))
        return kwargs

    def _callback(self, batch: list[StageRequest], control: StageControl, size: tuple[int, int]):
        def on_step_end(pipe: Any, i: int, t: Any, callback_kwargs: dict) -> dict:
            total = int(getattr(pipe, "_num_timesteps", 0) or 0) or i + 1
            want = [r for r in batch if control.wants_preview(r, i + 1, total)]
            previews = self._previews(pipe, batch, want, callback_kwargs, size) if want else None
            control.step(batch, i + 1, total, previews)
            self.tracer.mark("step")
            return callback_kwargs

        return on_step_end

    def _previews(
        self,
        pipe: Any,
        batch: list[StageRequest],
        want: list[StageRequest],
        callback_kwargs: dict,
        size: tuple[int, int],
    ) -> dict[str, Any]:
        """Decode the current latents of the first image of each request that asked."""
        latents = callback_kwargs.get("latents")
        if latents is None:
            return {}
        latents = self.adapter.loop_latents(latents, *size)
        first, k = {}, 0
        for r in batch:
            first[r.request_id] = k
            k += r.params.n
        with torch.inference_mode():
            return self._preview_images(pipe, want, first, latents)
