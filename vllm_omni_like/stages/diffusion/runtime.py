"""What the diffusion stage's load builds (load.py): one `DiffusionRuntime`, which the stage, its
two loops (own_loop.py, pipeline_call.py) and the running set (running_set.py) each receive,
and the little they share: a request's rows and prompt, the preview decode, the deferred
decode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni_like.config import StageConfig
from vllm_omni_like.models.adapter import Adapter
from vllm_omni_like.models.columns import to_device
from vllm_omni_like.models.family import Family, Loop
from vllm_omni_like.models.limits import ModelLimits
from vllm_omni_like.outputs import StageOutput
from vllm_omni_like.parallel import cfg_parallel
from vllm_omni_like.parallel.branches import BatchedCFG
from vllm_omni_like.parallel.rank_link import Link
from vllm_omni_like.parallel.sequence_parallel import SequenceFollower, SequenceLeader
from vllm_omni_like.stages.base import Deferred
from vllm_omni_like.stages.diffusion import edits, vae_decode, video_stream
from vllm_omni_like.stages.diffusion.edit_rows import Source
from vllm_omni_like.stages.diffusion.loop_rows import Settings
from vllm_omni_like.stages.diffusion.prompt_embeds import PromptEncoder
from vllm_omni_like.stages.diffusion.prompt_length import truncate_prompt
from vllm_omni_like.stages.diffusion.step import DenoiseLoop
from vllm_omni_like.stages.torch_utils import BatchDimProbe, tensor_to_uint8
from vllm_omni_like.stages.trace import BatchTracer
from vllm_omni_like.wire import Mode, StageRequest


@dataclass(frozen=True)
class Defaults:
    """What a request leaves unsaid."""

    width: int
    height: int
    steps: int
    guidance: float
    frames: int  # a video's


@dataclass(frozen=True)
class Speed:
    """What makes the model fast (none of it changes the maths)."""

    attention: str  # the attention kernels that run
    channels_last: bool
    tuned: list[str]  # the kernels tuned, for the start-up log


@dataclass(eq=False)
class CfgRanks:
    """CFG-parallel: this rank's side of the two (rank 0 leads, rank 1 serves its denoiser)."""

    link: Link
    leader: cfg_parallel.Leader | None  # rank 0's
    follower: cfg_parallel.Follower | None  # rank 1's
    branch_model: Any  # the denoiser rank 1 serves, compiled or not (a test wraps it)


@dataclass(eq=False)
class SequenceRanks:
    """Sequence parallelism: this rank's side of the N (rank 0 leads, the others serve its
    forwards, each with its share of the tokens)."""

    link: Link
    leader: SequenceLeader | None  # rank 0's
    follower: SequenceFollower | None  # the others'
    models: dict[str, Any]  # the denoisers by name, compiled or not (a test wraps them)


@dataclass(eq=False)
class DiffusionRuntime:
    """A loaded diffusion stage, its fields in the order the load builds them (load.py's
    steps). Not frozen: a test swaps a field (`own`, `buckets`, `cfg`, `config`) to run another
    path on the same models. A CFG-parallel rank 1 (a sequence-parallel rank > 0) runs its
    denoiser only: its probe is attached to nothing, it has no edit pipelines and no side
    stream."""

    config: StageConfig
    # 1. where it runs
    device: torch.device
    dtype: torch.dtype  # the weights' as loaded
    tracer: BatchTracer
    # 2. the pipeline, what its family says of it, and which loop runs each mode
    family: Family
    pipe: Any  # a diffusers pipeline (untyped upstream)
    adapter: Adapter
    loops: dict[Mode, tuple[Loop, str | None]]  # mode -> ("own" or "pipeline", why not own)
    own: set[Mode]  # the modes our own loop runs
    # 3. text, limits, what a request leaves unsaid
    text: PromptEncoder  # (its tokenizer; a dummy's random embeddings)
    limits: ModelLimits
    defaults: Defaults
    # 4. speed: kernels, memory format, compilation
    speed: Speed
    precision: str  # what its denoisers' matmuls run: "fp8", or the weights' dtype ("bf16")
    scheduler: Any  # the pipeline call's default scheduler
    buckets: tuple[int, ...]  # the batch sizes a compiled denoiser was warmed up for
    # 5. our own loop
    denoise: DenoiseLoop
    # 6. guidance: batched in one forward, or split over CFG-parallel ranks
    cfg: BatchedCFG | cfg_parallel.SplitCFG | None  # the denoiser's CFG wrapper, if any
    cfg_ranks: CfgRanks | None  # None: not CFG-parallel
    seq_ranks: SequenceRanks | None  # None: not sequence-parallel
    # 7. what runs beside the steps
    probe: BatchDimProbe  # the batch the denoiser's kernels get
    edit_pipes: dict[str, Any]  # "edit" / "inpaint" / "image2video" -> a pipeline sharing models
    side_stream: torch.cuda.Stream | None  # a deferred batch's decode, beside the next's steps

    @property
    def name(self) -> str:
        """The stage's (logs, errors)."""
        return self.config.name

    @property
    def is_video(self) -> bool:
        return self.family.output == "video"

    def rows_of(self, request: StageRequest) -> int:
        """A request's rows: its `n` images, or one video."""
        return 1 if self.is_video else request.params.n

    def prompt_of(self, request: StageRequest) -> str:
        """A request's prompt, truncated to its text encoder's length where it asked."""
        tokenizer = self.text.tokenizer
        if request.truncate_prompt and tokenizer is not None:
            return truncate_prompt(tokenizer, request.prompt, self.name)
        return request.prompt

    def settings(self) -> Settings:
        """What our own loop fills in for a request that leaves it unsaid."""
        d = self.defaults
        return Settings(
            d.steps, d.guidance, self.rows_of, self.prompt_of, self.source_of, self.image_of
        )

    def size_of(self, request: StageRequest) -> tuple[int, int]:
        """The width and height a request makes (an edit's default: its upload's)."""
        if request.mode == Mode.EDIT:
            return edits.edit_size(request, self.limits.size_multiple)
        p, d = request.params, self.defaults
        return p.width or d.width, p.height or d.height

    def source_of(self, request: StageRequest, size: tuple[int, int]) -> Source | None:
        """An image-to-image or inpainting edit's upload (and mask) on the device, as its
        pipeline's processors make them (None: a row from noise)."""
        mode = request.loop_mode
        if mode not in (Mode.EDIT, Mode.INPAINT) or not self.family.edit_strength:
            return None
        pipe = self.edit_pipes[mode]
        pixels = to_device(edits.source_pixels(request, pipe.image_processor, *size), self.device)
        if mode == Mode.EDIT:
            return Source(pixels)
        mask = edits.mask_pixels(request, pipe.mask_processor, *size)
        return Source(pixels, to_device(mask, self.device))  # (pinned copies: no wait)

    def image_of(self, request: StageRequest, size: tuple[int, int]) -> Any | None:
        """The image our loop conditions a request's rows on: an image-to-video request's first
        frame fitted to `size`, an instruction edit's upload as sent (the family fits it); None:
        none (a row from text, or an image-to-image edit, which starts from its source)."""
        mode = request.loop_mode
        if mode == Mode.IMAGE2VIDEO:
            return edits.first_frame(request, *size)
        if mode == Mode.EDIT and not self.family.edit_strength:
            return edits.upload_image(request)
        return None

    def preview_images(
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
            k += self.rows_of(r)

        def finish(requests: list[StageRequest]) -> list[StageOutput]:
            picked = [
                i
                for r in requests
                for i in range(first_row[r.request_id], first_row[r.request_id] + self.rows_of(r))
            ]
            fps = [r.params.fps or 8 for r in requests] if self.is_video else None
            png = any(r.encodes_png for r in requests)  # (the decode filters images only)
            pixels, encoded = decode(picked, fps, frames, png)
            return vae_decode.split_outputs(
                self.name, requests, pixels, [seeds[i] for i in picked], encoded, self.is_video
            )

        return Deferred(batch, finish)
