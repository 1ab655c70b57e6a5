"""H.264 MP4 videos: an incremental encoder (frames appended as they are made), and decoding.

One encoder path for everything: `encode_video` and `write_video` append all frames at once, a
diffusion stage appends each chunk of frames as its VAE decodes it
(stages/diffusion/video_stream.py), so a video encoded either way is the same bytes. CPU work:
callers keep it off the event loop.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import subprocess
import tempfile
from fractions import Fraction
from typing import Any

import numpy as np

# x264's `veryfast` preset: the encode is on every video's critical path, and it took 0.43 s
# against the default preset's 1.45 s for 33 frames of 832x480 on this project's CPU, for a
# smaller file of the same PSNR.
X264_PRESET = "veryfast"
# PyAV's bundled libx264 (x264 core 165) encodes the same frames to different bytes now and
# then on a CPU with AVX-512 (measured on a 16-core host of an H100: with its frame threads or
# one thread, while torch works beside it), never with its AVX-512 code left out: there x264
# gets the CPU's flags up to AVX2 (`asm=AVX2`, which a CPU with AVX-512 always has), so a video
# streamed chunk by chunk is the bytes of encoding it whole. Same speed (bench/README.md).
X264_CAP_WITHOUT = "avx512f"


@functools.cache
def pyav_x264_params(cpuinfo: str = "/proc/cpuinfo") -> dict[str, str]:
    """libx264's options for PyAV on this CPU: its assembly capped at AVX2 where AVX-512 is."""
    try:
        with open(cpuinfo) as f:
            flags = next(
                (line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []
            )
    except OSError:  # not Linux: x264 detects the CPU itself
        return {}
    return {"x264-params": "asm=AVX2"} if X264_CAP_WITHOUT in flags else {}


class VideoWriter:
    """An H.264 MP4 (moov atom first: faststart) written to `path` frame by frame.

    Encoded by imageio's bundled ffmpeg, a process of its own that encodes the frames already
    written while more are made; where imageio-ffmpeg is missing, by PyAV's libx264 (the same
    codec, pixel format and container flags; every frame timestamped here). Odd sides are
    padded by one edge pixel (yuv420p needs even sides). `close()` finishes the file;
    `discard()` stops and removes it.
    """

    def __init__(self, path: str, fps: int, pyav: bool = False) -> None:
        self.path, self.fps, self.pyav = path, fps, pyav  # pyav: PyAV even with imageio-ffmpeg
        self._writer: Any = None  # opened on the first frames, when their size is known
        self._av: Any = None
        self.appends = 0
        self.frames = 0  # written so far: the next frame's timestamp (in 1/fps)

    def append(self, frames: np.ndarray) -> None:
        """FxHxWx3 uint8 frames, in order."""
        h, w = frames.shape[1:3]
        if h % 2 or w % 2:
            frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
        if self._writer is None and self._av is None:
            self._open(frames.shape[1:3])
        self.appends += 1
        if self._writer is not None:
            for frame in frames:
                self._writer.append_data(frame)
            return
        container, stream = self._av
        import av

        for frame in frames:  # each frame's timestamp set here: none left for PyAV to guess
            picture = av.VideoFrame.from_ndarray(frame, format="rgb24")
            picture.pts, picture.time_base = self.frames, Fraction(1, self.fps)
            self.frames += 1
            container.mux(stream.encode(picture))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        elif self._av is not None:
            container, stream = self._av
            container.mux(stream.encode())
            container.close()
        else:
            raise ValueError("a video needs at least one frame")
        self._writer = self._av = None

    def discard(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def _open(self, size: tuple[int, int]) -> None:
        try:
            if self.pyav:
                raise ImportError("PyAV asked for")
            import imageio_ffmpeg  # noqa: F401 - only asks whether the plugin can run
        except ImportError:
            import av

            container = av.open(self.path, "w", format="mp4", options={"movflags": "+faststart"})
            stream = container.add_stream("libx264", rate=self.fps)
            stream.codec_context.time_base = Fraction(1, self.fps)
            stream.height, stream.width = size
            stream.pix_fmt = "yuv420p"
            stream.options = {"preset": X264_PRESET, **pyav_x264_params()}
            self._av = (container, stream)
            return
        import imageio.v2 as imageio

        self._writer = imageio.get_writer(
            self.path,
            format="FFMPEG",
            mode="I",
            fps=self.fps,
            codec="libx264",
            pixelformat="yuv420p",
            macro_block_size=1,
            output_params=["-movflags", "+faststart", "-preset", X264_PRESET],
            ffmpeg_log_level="error",
        )


class VideoBytes:
    """A `VideoWriter` into a temporary file whose bytes `finish()` returns (and removes)."""

    def __init__(self, fps: int) -> None:
        fd, path = tempfile.mkstemp(suffix=".mp4")
        os.close(fd)
        self.writer = VideoWriter(path, fps)

    def append(self, frames: np.ndarray) -> None:
        self.writer.append(frames)

    def finish(self) -> bytes:
        try:
            self.writer.close()
            with open(self.writer.path, "rb") as f:
                return f.read()
        finally:
            self.discard()

    def discard(self) -> None:
        self.writer.discard()


def write_video(frames: np.ndarray, fps: int, path: str) -> None:
    writer = VideoWriter(path, fps)
    try:
        writer.append(frames)
        writer.close()
    except BaseException:
        writer.discard()
        raise


def encode_video(frames: np.ndarray, fps: int) -> bytes:
    video = VideoBytes(fps)
    try:
        video.append(frames)
    except BaseException:
        video.discard()
        raise
    return video.finish()


def decode_video(data: bytes) -> np.ndarray:
    """An encoded video's frames (FxHxWx3 uint8): encode_video's inverse, for tests and checks."""
    fd, path = tempfile.mkstemp(suffix=".mp4")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    try:
        return read_video(path)
    finally:
        os.unlink(path)


def read_video(path: str) -> np.ndarray:
    """Decode a video to FxHxWx3 uint8 with the bundled ffmpeg (or PyAV) - for tests and checks."""
    try:
        import imageio_ffmpeg
    except ImportError:
        import av

        with av.open(path) as container:
            return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
    exe = imageio_ffmpeg.get_ffmpeg_exe()
    info = subprocess.run([exe, "-hide_banner", "-i", path], capture_output=True, text=True)
    size = re.search(r"Video:.*?, (\d+)x(\d+)", info.stderr)
    if size is None:
        raise ValueError(f"{path}: no video stream found")
    w, h = int(size.group(1)), int(size.group(2))
    raw = subprocess.run(
        [exe, "-v", "error", "-i", path, "-f", "rawvideo", "-pix_fmt", "rgb24", "-"],
        capture_output=True,
        check=True,
    ).stdout
    return np.frombuffer(raw, np.uint8).reshape(-1, h, w, 3)
