"""The diffusion stage's side of the diffusers pipeline's own call: the modes our loop does not
run (inpainting; every mode of a generic family or of CFG-parallel ranks). Whole requests batched
together (one step count, guidance and scheduler a batch: the batching key holds them), with
CFG batched or split over ranks by wrapping the denoiser. It receives the stage's runtime
(runtime.py)."""

from __future__ import annotations

import random
from typing import Any

import torch

from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.base import Deferred, StageControl
from vllm_omni_like.stages.diffusion import acceleration as accel
from vllm_omni_like.stages.diffusion import edits
from vllm_omni_like.stages.diffusion.prompt_embeds import random_prompt_embeds
from vllm_omni_like.stages.diffusion.prompt_length import truncate_prompt
from vllm_omni_like.stages.diffusion.runtime import DiffusionRuntime
from vllm_omni_like.wire import Mode, StageRequest


class PipelineCall:
    """Runs a batch through the pipeline's `__call__`."""

    def __init__(self, runtime: DiffusionRuntime) -> None:
        self.runtime = runtime

    def begin(self, batch: list[StageRequest], control: StageControl) -> Deferred:
        """The pipeline's call; the returned part decodes its latents (where the adapter knows
        the decode: else the call did)."""
        adapter = self.runtime.adapter
        pipe, kwargs, _, seeds = self._prepare(batch, control)
        decoder = adapter.decoder(pipe)
        if decoder is not None:
            kwargs["output_type"] = "latent"
        media = adapter.media(self._denoise(pipe, kwargs, control))
        if decoder is not None:  # (latents, in our loop's layout)
            media = adapter.loop_latents(media, kwargs["width"], kwargs["height"])
        frames = kwargs.get("num_frames", 0)  # a video's, as the pipeline was asked
        return self.runtime.defer(batch, media, seeds, frames, decoder)

    def warm_up(self, rows: int, width: int, height: int, mode: str = "") -> None:
        """Two steps of the pipeline's call in `mode` (the model's first by default); a mode
        of `edit_pipes` (an edit, an image-to-video call) starts from a blank image."""
        rt = self.runtime
        mode = mode or next(iter(rt.loops))
        gens = [torch.Generator(device=rt.device).manual_seed(0) for _ in range(rows)]
        guidance = rt.defaults.guidance
        kwargs = self._call_kwargs(["warm-up"] * rows, [""] * rows, gens, 2, guidance)
        kwargs.update(width=width, height=height)
        if rt.is_video:
            kwargs["num_frames"] = rt.defaults.frames
        pipe = rt.pipe
        if mode in rt.edit_pipes:
            from PIL import Image

            blank = Image.new("RGB", (width, height))
            pipe = rt.edit_pipes[mode]
            # an image-to-video call takes its one first frame; an edit an image a row
            kwargs["image"] = blank if mode == Mode.IMAGE2VIDEO else [blank] * rows
        self._run(pipe, kwargs)

    def _prepare(
        self, batch: list[StageRequest], control: StageControl
    ) -> tuple[Any, dict[str, Any], int, list[int]]:
        """The pipeline and its call for `batch`, the number of real rows and their seeds."""
        rt, d = self.runtime, self.runtime.defaults
        first = batch[0]
        p = first.params
        prompts, negatives, generators, seeds = [], [], [], []
        for r in batch:
            base = r.params.seed if r.params.seed is not None else random.randrange(2**31)
            for i in range(rt.rows_of(r)):
                prompts.append(r.prompt)
                negatives.append(r.params.negative_prompt or "")
                seeds.append(base + i)
                generators.append(torch.Generator(device=rt.device).manual_seed(base + i))
        tokenizer = rt.text.tokenizer
        if tokenizer is not None and any(r.truncate_prompt for r in batch):
            prompts = [truncate_prompt(tokenizer, t, rt.name) for t in prompts]
        rows = len(prompts)
        # a compiled denoiser runs only the shapes it was warmed up for: pad to the bucket
        for _ in range(accel.bucket_for(rows, rt.buckets) - rows):
            prompts.append(prompts[-1])
            negatives.append(negatives[-1])
            generators.append(torch.Generator(device=rt.device).manual_seed(0))
        guidance = d.guidance if p.guidance_scale is None else p.guidance_scale
        steps = p.num_inference_steps or d.steps
        # (one guidance a batch, a family's second scale too: the batching key holds them)
        kwargs = self._call_kwargs(prompts, negatives, generators, steps, guidance, p)
        if rt.is_video:
            kwargs["num_frames"] = p.num_frames or d.frames
        pipe = rt.pipe
        if first.mode == Mode.EDIT:
            pad, multiple = len(prompts) - rows, rt.limits.size_multiple
            mode = edits.edit_inputs(batch, kwargs, pad, multiple, rt.family.edit_strength)
            pipe = rt.edit_pipes[mode]
        elif first.mode == Mode.IMAGE2VIDEO:  # (one request a batch: the batching key)
            size = (p.width or d.width, p.height or d.height)
            kwargs["image"] = edits.first_frame(first, *size)
            pipe = rt.edit_pipes[Mode.IMAGE2VIDEO]
        # the batch's scheduler (one per batch here: the batching key holds it)
        pipe.scheduler = rt.adapter.scheduler(p.scheduler) if p.scheduler else rt.scheduler
        kwargs.setdefault("height", p.height or d.height)
        kwargs.setdefault("width", p.width or d.width)
        kwargs["callback_on_step_end"] = self._callback(
            batch, control, (kwargs["width"], kwargs["height"])
        )
        return pipe, kwargs, rows, seeds

    def _denoise(self, pipe: Any, kwargs: dict[str, Any], control: StageControl) -> Any:
        rt = self.runtime
        rt.probe.reset()
        with rt.tracer.batch():
            result = self._run(pipe, kwargs)
            if rt.device.type == "cuda":  # no step waits on the device (HostUniPC): the loop
                torch.cuda.current_stream(rt.device).synchronize()  # ends when its steps do
            rt.tracer.mark("synced")
        control.saw_model_batch(rt.probe.max_seen)
        return result

    def _run(self, pipe: Any, kwargs: dict[str, Any]) -> Any:
        """One pipeline call; with CFG, both halves in one forward on a two-call pipeline, or
        on two ranks (CFG-parallel)."""
        rt, cfg = self.runtime, self.runtime.cfg
        if cfg is not None and kwargs.get("guidance_scale", 0.0) > 1.0:
            if cfg.needs_embeddings and "prompt_embeds" not in kwargs:  # the negative half
                kwargs["prompt_embeds"], kwargs["negative_prompt_embeds"] = (
                    rt.adapter.encode_prompt(kwargs, rt.device)
                )
            if cfg.needs_embeddings:
                for key in ("prompt_embeds", "negative_prompt_embeds"):
                    kwargs[key] = kwargs[key].to(rt.text.dtype)  # the pipeline's: no-op
            cfg.arm(kwargs)
        try:
            with torch.inference_mode():
                result = pipe(**kwargs)
            if cfg is not None:
                cfg.settle()
            return result
        finally:
            if cfg is not None:
                cfg.disarm()

    def _call_kwargs(
        self,
        prompts: list[str],
        negatives: list[str],
        generators: list[torch.Generator],
        steps: int,
        guidance: float,
        params: GenerationParams | None = None,
    ) -> dict[str, Any]:
        rt, text = self.runtime, self.runtime.text
        kwargs: dict[str, Any] = {
            "num_inference_steps": steps,
            **rt.adapter.guidance_kwargs(guidance, params),
            "output_type": "pt",
            "generator": generators,
        }
        if text.random_shape is not None:  # no text encoder: seeded random embeddings
            seq_len, dim = text.random_shape
            dtype, device = text.dtype, rt.device
            kwargs["prompt_embeds"] = random_prompt_embeds(prompts, seq_len, dim, dtype, device)
            kwargs["negative_prompt_embeds"] = random_prompt_embeds(
                negatives, seq_len, dim, dtype, device
            )
            kwargs["max_sequence_length"] = seq_len
            return kwargs
        kwargs.update(rt.adapter.text_kwargs(prompts, negatives, text.tokenizer))
        return kwargs

    def _callback(self, batch: list[StageRequest], control: StageControl, size: tuple[int, int]):
        def on_step_end(pipe: Any, i: int, t: Any, callback_kwargs: dict) -> dict:
            total = int(getattr(pipe, "_num_timesteps", 0) or 0) or i + 1
            want = [r for r in batch if control.wants_preview(r, i + 1, total)]
            previews = self._previews(pipe, batch, want, callback_kwargs, size) if want else None
            control.step(batch, i + 1, total, previews)
            self.runtime.tracer.mark("step")
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
        latents = self.runtime.adapter.loop_latents(latents, *size)
        first, k = {}, 0
        for r in batch:
            first[r.request_id] = k
            k += r.params.n
        with torch.inference_mode():
            return self.runtime.preview_images(pipe, want, first, latents)
