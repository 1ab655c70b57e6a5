"""A video's MP4 encoded while its VAE still decodes it.

A family whose VAE decodes a video chunk by chunk (Wan's: latent frame by latent frame) names
the module that makes each chunk and how its output becomes uint8 frames with the same maths as
the whole video's post-processing (the adapter's `chunk_source`, models/adapter.py). A forward
hook on that module hands each chunk's frames to a thread that appends them to one encoder per
video: the encoder works on the first frames while the GPU decodes the next. On CUDA the chunk
is copied to pinned host memory without waiting; the thread waits on the copy's event, so the
decode never waits for the host. What is left after the decode is the encode of the last chunk
and the file's end. The same thread encodes each video's thumbnail (its middle frame as PNG,
what the videos API stores beside the MP4) when that frame goes by, so the API has nothing left
to encode.

A failed encode (no encoder, an ffmpeg error) costs nothing but the overlap: its videos carry
no MP4 and the API encodes their frames itself, as it does for stages that do not stream.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_omni_like.media import encode_image
from vllm_omni_like.models.adapter import ChunkSource
from vllm_omni_like.video_codec import VideoBytes

log = logging.getLogger(__name__)


@dataclass
class Encoded:
    """What the stage encoded for one row while it decoded: a video's files (its MP4 and its
    thumbnail, PNG of the middle frame), an image's rows PNG-filtered on the device
    (png_rows.py); None for what it did not make (the API makes it from the pixels)."""

    mp4: bytes | None = None
    thumbnail: bytes | None = None
    scanlines: Any = None


class StreamedMP4:
    """While entered, every call of `source` sends its frames of rows 0..len(fps)-1 to one MP4
    encoder per row (at `fps[row]` frames per second), and encodes each row's frame `middle`
    (the middle one of the `frames` the caller expects) as its thumbnail. `result()`: each row's
    `Encoded`: no MP4 for any row if the encode failed, no thumbnail if the video did not have
    the expected number of frames."""

    def __init__(self, source: ChunkSource, fps: list[int], frames: int = 0) -> None:
        self.source, self.fps = source, fps
        self.expected, self.seen = frames, 0
        self.thumbnails: list[bytes | None] = [None] * len(fps)
        self.videos = [VideoBytes(f) for f in fps]
        self.chunks: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._encode, name="mp4-stream", daemon=True)
        self.hook: Any = None
        self.mp4: list[bytes] | None = None

    def __enter__(self) -> StreamedMP4:
        self.thread.start()
        self.hook = self.source.module.register_forward_hook(self._on_chunk)
        return self

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        self.hook.remove()
        self.chunks.put(None)
        self.thread.join()
        if kind is None and self.error is None:
            try:
                self.mp4 = [v.finish() for v in self.videos]
            except Exception as e:  # the API encodes the frames instead
                self.error = e
        if self.mp4 is None:  # (finish removed each file it read)
            for v in self.videos:
                v.discard()
        if self.error is not None and kind is None:
            log.warning("streamed MP4 encode failed (%s); the frames go out unencoded", self.error)

    def result(self) -> list[Encoded]:
        mp4s: list[bytes] | list[None] = self.mp4 or [None] * len(self.fps)
        whole = self.error is None and self.seen == self.expected  # (else: the API's thumbnail)
        thumbs = self.thumbnails if whole else [None] * len(self.fps)
        return [Encoded(m, t) for m, t in zip(mp4s, thumbs, strict=True)]

    def _on_chunk(self, module: Any, args: Any, out: torch.Tensor) -> None:
        pixels = self.source.to_pixels(out[: len(self.fps)])
        if pixels.device.type != "cuda":
            self.chunks.put((None, pixels.cpu()))
            return
        host = torch.empty(pixels.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(pixels, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self.chunks.put((copied, host))

    def _encode(self) -> None:
        while (item := self.chunks.get()) is not None:
            if self.error is not None:
                continue  # drain: the decode goes on; the API will encode
            copied, host = item
            try:
                if copied is not None:
                    copied.synchronize()
                frames = host.numpy()
                for row, video in enumerate(self.videos):
                    video.append(np.ascontiguousarray(frames[row]))
                middle = self.expected // 2 - self.seen  # in this chunk's frames
                if 0 <= middle < frames.shape[1]:
                    for row in range(len(self.videos)):
                        self.thumbnails[row] = encode_image(frames[row, middle])
                self.seen += frames.shape[1]
            except Exception as e:  # reported once the decode ends
                self.error = e
