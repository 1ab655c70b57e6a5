"""The end of a diffusers pipeline call - latents to pixels - run apart from its denoising loop.

A stage that defers its decode calls the pipeline with `output_type="latent"` and later decodes
with the decoder its family's adapter gives (models/<family>/adapter.py): the same operations,
in the same order, as that pipeline's own `output_type="pt"` path (checked byte for byte by the
contract tests), so the images do not change. Pipelines whose adapter has no decoder decode
inside the call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from vllm_omni_like.models.adapter import ChunkSource, Decoder
from vllm_omni_like.outputs import ImagePayload, StageOutput, VideoPayload
from vllm_omni_like.stages.diffusion.acceleration import bucket_for
from vllm_omni_like.stages.diffusion.png_rows import filter_scanlines, worth_filtering
from vllm_omni_like.stages.diffusion.video_stream import Encoded, StreamedMP4
from vllm_omni_like.stages.torch_utils import device_uint8, tensor_to_uint8
from vllm_omni_like.wire import StageRequest


class PendingDecode:
    """The latents of one denoised batch, decoded row by row subset when asked (`__call__`).

    On CUDA the decode runs on `stream`, a side stream that first waits for the main stream's
    work up to now (the last denoising step): the main stream is free for the next batch at
    once, and the two overlap on the GPU.
    """

    def __init__(
        self,
        decoder: Decoder,
        latents: torch.Tensor,
        stream: torch.cuda.Stream | None,
        buckets: tuple[int, ...] = (),
        chunks: ChunkSource | None = None,
    ) -> None:
        self.decoder = decoder
        self.chunks = chunks  # where a video's frames come from chunk by chunk (video_stream)
        self.latents = latents
        self.stream = stream
        self.buckets = buckets  # a compiled decoder runs only these batch sizes: pad up
        self.ready: torch.cuda.Event | None = None
        if stream is not None:
            self.ready = torch.cuda.Event()
            self.ready.record()  # on the main stream, after the last step's kernels

    def __call__(
        self, picked: list[int], fps: list[int] | None = None, frames: int = 0, png: bool = False
    ) -> tuple[np.ndarray, list[Encoded]]:
        """uint8 pixels of the `picked` rows, on the host; with `fps` (videos, a rate per row,
        of `frames` frames) and a chunked decoder, each row's MP4 and thumbnail encoded while it
        decodes (else empty `Encoded`s); `png` (images): each row's PNG-filtered rows, made on
        the device (`Encoded.scanlines`; png_rows.py)."""
        with torch.inference_mode(), self._on_side_stream():
            rows = self.latents[picked]
            if not bool(torch.isfinite(rows).all()):  # (its bisection fails only that row)
                raise FloatingPointError("the denoised latents are not finite (NaN or inf)")
            pad = bucket_for(len(picked), self.buckets) - len(picked)  # no buckets: 0
            if pad:
                rows = torch.cat([rows, rows[-1:].expand(pad, *rows.shape[1:])])
            if fps is None or self.chunks is None:
                images = device_uint8(self.decoder(rows)[: len(picked)])
                if png and images.dim() == 4 and worth_filtering(images.device, *images.shape[1:3]):
                    # one image at a time: its int16 work is about 0.2 GB at 1024x1024, beside the
                    # next set's steps (a decode group of 32 at once: about 6 GB)
                    rows_filtered = [
                        filter_scanlines(images[i : i + 1]) for i in range(len(images))
                    ]
                    scanlines = torch.cat(rows_filtered).cpu().numpy()
                    return images.cpu().numpy(), [Encoded(scanlines=row) for row in scanlines]
                return images.cpu().numpy(), [Encoded() for _ in picked]
            with StreamedMP4(self.chunks, fps, frames) as mp4:
                pixels = tensor_to_uint8(self.decoder(rows)[: len(picked)])
            return pixels, mp4.result()

    @contextlib.contextmanager
    def _on_side_stream(self) -> Iterator[None]:
        if self.stream is None or self.ready is None:
            yield
            return
        self.stream.wait_event(self.ready)
        self.latents.record_stream(self.stream)  # the main stream may not reuse it before
        with torch.cuda.stream(self.stream):
            yield


def split_outputs(
    stage: str,
    batch: list[StageRequest],
    pixels: np.ndarray,
    seeds: list[int],
    encoded: list[Encoded],
    is_video: bool,
) -> list[StageOutput]:
    """Each request's output from the decoded rows (a video: one row; images: `n` rows)."""
    outputs, k = [], 0
    for r in batch:
        out = StageOutput(request_id=r.request_id, stage=stage)
        if is_video:
            files, frames = encoded[k], pixels[k]
            fps = r.params.fps or 8
            out.video = VideoPayload(frames, fps, seeds[k], files.mp4, files.thumbnail)
            if r.files_only and files.mp4 is not None and files.thumbnail is not None:
                out.video.frames, out.video.dims = None, tuple(frames.shape[:3])
            k += 1
        else:
            for _ in range(r.params.n):
                filtered = encoded[k].scanlines if r.encodes_png else None
                out.images.append(ImagePayload(pixels[k], seeds[k], filtered))
                k += 1
        outputs.append(out)
    return outputs
