"""What the diffusion stage's load sets, typed once for the stage and its two loops' mixins
(own_loop.py, pipeline_call.py), and the little both loops share: a request's rows and the
preview decode."""

from __future__ import annotations

from typing import Any

import torch

from vllm_omni_like.models.adapter import Adapter
from vllm_omni_like.models.family import Family, Loop
from vllm_omni_like.models.limits import ModelLimits
from vllm_omni_like.outputs import StageOutput
from vllm_omni_like.parallel import cfg_parallel
from vllm_omni_like.parallel.branches import BatchedCFG
from vllm_omni_like.parallel.rank_link import Link
from vllm_omni_like.stages.base import Deferred, Stage
from vllm_omni_like.stages.diffusion import vae_decode, video_stream
from vllm_omni_like.stages.diffusion.prompt_length import truncate_prompt
from vllm_omni_like.stages.diffusion.step import DenoiseLoop
from vllm_omni_like.stages.torch_utils import BatchDimProbe, tensor_to_uint8
from vllm_omni_like.stages.trace import BatchTracer
from vllm_omni_like.wire import Mode, StageRequest


class DiffusionState(Stage):
    """The attributes `DiffusionStage.load` sets (its docstrings say what each is for)."""

    device: torch.device
    dtype: torch.dtype
    link: Link | None
    tracer: BatchTracer
    pipe: Any  # a diffusers pipeline (untyped upstream)
    family: Family
    adapter: Adapter
    is_video: bool
    loops: dict[Mode, tuple[Loop, str | None]]  # mode -> ("own" or "pipeline", why not own)
    own: set[Mode]  # the modes our own loop runs
    denoiser: Any  # the pipeline's UNet or transformer
    denoiser_dtype: torch.dtype
    tokenizer: Any  # a transformers tokenizer, or None (a dummy without text encoder)
    embed_shape: tuple[int, int] | None  # (seq_len, dim) of seeded random prompt embeddings
    limits: ModelLimits
    default_width: int
    default_height: int
    default_steps: int
    default_guidance: float
    default_frames: int
    attention: str
    channels_last: bool
    tuned: list[str]
    scheduler: Any  # the pipeline call's default scheduler
    buckets: tuple[int, ...]  # the batch sizes a compiled denoiser was warmed up for
    denoise: DenoiseLoop
    leader: cfg_parallel.Leader | None
    cfg: BatchedCFG | cfg_parallel.SplitCFG | None  # the denoiser's CFG wrapper, if any
    branch_model: Any
    follower: cfg_parallel.Follower
    probe: BatchDimProbe
    edit_pipes: dict[str, Any]  # "edit" / "inpaint" -> a pipeline sharing the models
    side_stream: torch.cuda.Stream | None

    def _rows(self, request: StageRequest) -> int:
        return 1 if self.is_video else request.params.n

    def _prompt(self, request: StageRequest) -> str:
        if request.truncate_prompt and self.tokenizer is not None:
            return truncate_prompt(self.tokenizer, request.prompt, self.name)
        return request.prompt

    def _preview_images(
        self, pipe: Any, want: list[StageRequest], first: dict[str, int], latents: torch.Tensor
    ) -> dict[str, Any]:
        """Partial images: the current latents of each asking request's first row (`first`),
        decoded as the adapter previews `pipe`'s (both loops)."""
        preview = self.adapter.preview(pipe)
        if preview is None:
            return {}
        picked = latents[[first[r.request_id] for r in want]]
        images = tensor_to_uint8(preview(picked))
        return {r.request_id: img for r, img in zip(want, images, strict=True)}

    def defer(
        self,
        batch: list[StageRequest],
        media: torch.Tensor,
        seeds: list[int],
        frames: int,
        decoder: Any,
    ) -> Deferred:
        """`batch`'s rows (`media`: latents, or a pipeline's pixels), their decode deferred."""
        rows = len(seeds)
        if decoder is None:  # a pipeline we cannot decode for: it did, in the call
            with torch.inference_mode():
                pixels = tensor_to_uint8(media[:rows])
            decode = lambda picked, fps, frames, png: (  # noqa: E731
                pixels[picked],
                [video_stream.Encoded() for _ in picked],
            )
        else:
            chunks = self.adapter.chunk_source() if self.is_video else None
            decode = vae_decode.PendingDecode(
                decoder, media, self.side_stream, self.buckets, chunks
            )
        first_row, k = {}, 0
        for r in batch:
            first_row[r.request_id] = k
            k += self._rows(r)

        def finish(requests: list[StageRequest]) -> list[StageOutput]:
            picked = [
                i
                for r in requests
                for i in range(first_row[r.request_id], first_row[r.request_id] + self._rows(r))
            ]
            fps = [r.params.fps or 8 for r in requests] if self.is_video else None
            png = any(r.encodes_png for r in requests)  # (the decode filters images only)
            pixels, encoded = decode(picked, fps, frames, png)
            return vae_decode.split_outputs(
                self.name, requests, pixels, [seeds[i] for i in picked], encoded, self.is_video
            )

        return Deferred(batch, finish)
