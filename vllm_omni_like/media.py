"""Encoding of what the stages make: images (PNG/JPEG/WebP) and H.264 MP4 videos.

CPU work: callers run it off the event loop (a thread) and off the GPU worker's critical path.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import tempfile

import numpy as np
from PIL import Image

from vllm_omni_like.errors import InvalidRequestError, PayloadTooLargeError

PNG_COMPRESS_LEVEL = 6  # the default of PIL and of the benchmark reference
MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


def encode_image(pixels: np.ndarray, fmt: str = "png", compression: int | None = None) -> bytes:
    """`compression` is OpenAI's output_compression (0-100): quality for JPEG/WebP."""
    buf = io.BytesIO()
    image = Image.fromarray(np.ascontiguousarray(pixels))
    if fmt == "png":
        level = PNG_COMPRESS_LEVEL if compression is None else round(compression * 9 / 100)
        image.save(buf, format="PNG", compress_level=level)
    elif fmt == "jpeg":
        image.save(buf, format="JPEG", quality=100 - (compression or 0) if compression else 90)
    elif fmt == "webp":
        image.save(buf, format="WEBP", quality=100 - (compression or 0) if compression else 90)
    else:
        raise InvalidRequestError(f"output_format {fmt!r} is not supported", param="output_format")
    return buf.getvalue()


def decode_upload(
    data: bytes, max_bytes: int, max_pixels: int, param: str = "image", mode: str = "RGB"
) -> np.ndarray:
    """An uploaded PNG/JPEG/WebP -> HxWxC uint8; bad or oversized uploads are refused."""
    if len(data) > max_bytes:
        raise PayloadTooLargeError(
            f"{param} is {len(data)} bytes; at most {max_bytes}", param=param
        )
    try:
        image = Image.open(io.BytesIO(data))
        if image.format not in ("PNG", "JPEG", "WEBP"):
            raise InvalidRequestError(
                f"{param} must be PNG, JPEG or WebP, not {image.format}",
                param=param,
                code="invalid_image",
            )
        if image.width * image.height > max_pixels:
            raise InvalidRequestError(
                f"{param} is {image.width}x{image.height}; at most {max_pixels} pixels",
                param=param,
                code="invalid_image",
            )
        return np.asarray(image.convert(mode))
    except InvalidRequestError:
        raise
    except Exception as exc:
        raise InvalidRequestError(
            f"{param} is not a readable image: {exc}", param=param, code="invalid_image"
        ) from exc


def openai_mask_to_diffusers(rgba: np.ndarray) -> np.ndarray:
    """OpenAI: fully transparent pixels mark the edit. diffusers: white (255) means repaint."""
    return np.where(rgba[..., 3] == 0, 255, 0).astype(np.uint8)


def write_video(frames: np.ndarray, fps: int, path: str) -> None:
    """H.264 MP4 with the moov atom first (faststart), written to `path`.

    Encoded by imageio's bundled ffmpeg; where imageio-ffmpeg is missing, by PyAV's libx264
    (the same codec, pixel format and container flags).
    """
    h, w = frames.shape[1:3]
    if h % 2 or w % 2:  # yuv420p needs even sides
        frames = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), mode="edge")
    try:
        import imageio_ffmpeg  # noqa: F401 - only asks whether the plugin can run
    except ImportError:
        _write_video_pyav(frames, fps, path)
        return
    import imageio.v2 as imageio

    writer = imageio.get_writer(
        path,
        format="FFMPEG",
        mode="I",
        fps=fps,
        codec="libx264",
        pixelformat="yuv420p",
        macro_block_size=1,
        output_params=["-movflags", "+faststart"],
        ffmpeg_log_level="error",
    )
    try:
        for frame in frames:
            writer.append_data(frame)
    finally:
        writer.close()


def _write_video_pyav(frames: np.ndarray, fps: int, path: str) -> None:
    import av

    with av.open(path, "w", format="mp4", options={"movflags": "+faststart"}) as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


def encode_video(frames: np.ndarray, fps: int) -> bytes:
    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        write_video(frames, fps, path)
        with open(path, "rb") as f:
            return f.read()
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
