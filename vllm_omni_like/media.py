"""Encoding of what the stages make: images (PNG/JPEG/WebP) and H.264 MP4 videos.

CPU work: callers run it off the event loop (a thread) and off the GPU worker's critical path.
"""

from __future__ import annotations

import io
import re
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from vllm_omni_like.errors import InvalidRequestError, PayloadTooLargeError
from vllm_omni_like.png import MIN_PIXELS, claim, encode_png

PNG_COMPRESS_LEVEL = 6  # the default of PIL and of the benchmark reference
MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}


def encode_image(
    pixels: np.ndarray,
    fmt: str = "png",
    compression: int | None = None,
    scanlines: np.ndarray | None = None,
) -> bytes:
    """`compression` is OpenAI's output_compression (0-100): quality for JPEG/WebP.
    `scanlines`: the image's rows already PNG-filtered (`ImagePayload.scanlines`)."""
    buf = io.BytesIO()
    image = Image.fromarray(np.ascontiguousarray(pixels))
    if fmt == "png":
        level = PNG_COMPRESS_LEVEL if compression is None else round(compression * 9 / 100)
        if pixels.shape[0] * pixels.shape[1] >= MIN_PIXELS:
            with claim() as pool:
                if pool or scanlines is not None:  # a large image: on several cores while the
                    # pool is free (png.py); filtered already, deflate alone here beats PIL
                    return encode_png(pixels, level, scanlines=scanlines, pool=pool)
        image.save(buf, format="PNG", compress_level=level)
    elif fmt == "jpeg":
        image.save(buf, format="JPEG", quality=100 - (compression or 0) if compression else 90)
    elif fmt == "webp":
        image.save(buf, format="WEBP", quality=100 - (compression or 0) if compression else 90)
    else:
        raise InvalidRequestError(f"output_format {fmt!r} is not supported", param="output_format")
    return buf.getvalue()


def open_upload(data: bytes, max_bytes: int, max_pixels: int, param: str = "image") -> Any:
    """An uploaded PNG/JPEG/WebP as a PIL image, its pixels loaded; bad or oversized uploads are
    refused (413 over the byte limit, 400 otherwise)."""
    if len(data) > max_bytes:
        raise upload_too_large(param, max_bytes)
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
        image.load()
        return image
    except InvalidRequestError:
        raise
    except UnidentifiedImageError:
        raise InvalidRequestError(
            f"{param} is not a readable image: not a PNG, JPEG or WebP file",
            param=param,
            code="invalid_image",
        ) from None
    except Exception as exc:  # PIL names its file object (`<_io.BytesIO object at 0x..>`)
        detail = re.sub(r"<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "the file", str(exc))
        raise InvalidRequestError(
            f"{param} is not a readable image: {detail}", param=param, code="invalid_image"
        ) from None


def upload_too_large(param: str, max_bytes: int, size: int | None = None) -> PayloadTooLargeError:
    """413 for an upload over the byte limit; its size where known (else only that it is over)."""
    said = f"{size} bytes, over" if size is not None else "over"
    return PayloadTooLargeError(f"{param} is {said} the limit of {max_bytes} bytes", param=param)


def decode_upload(data: bytes, max_bytes: int, max_pixels: int, param: str = "image") -> np.ndarray:
    """An uploaded image -> HxWx3 uint8."""
    return np.asarray(open_upload(data, max_bytes, max_pixels, param).convert("RGB"))


def decode_mask(data: bytes, max_bytes: int, max_pixels: int, param: str = "mask") -> np.ndarray:
    """An uploaded mask -> HxW uint8 in diffusers' convention (255 = repaint).

    Two conventions are read: OpenAI's, a PNG whose fully transparent pixels mark the edit
    (used when the mask has an alpha channel that is not fully opaque), and otherwise the
    greyscale one, white (>= 128) marks the edit. A mask that marks nothing is refused.
    """
    image = open_upload(data, max_bytes, max_pixels, param)
    has_alpha = "A" in image.getbands() or "transparency" in image.info
    alpha = np.asarray(image.convert("RGBA"))[..., 3] if has_alpha else None
    if alpha is not None and (alpha < 255).any():
        mask = np.where(alpha == 0, 255, 0).astype(np.uint8)
        how = "no fully transparent pixel"
    else:
        mask = np.where(np.asarray(image.convert("L")) >= 128, 255, 0).astype(np.uint8)
        how = "no transparent pixel (alpha) and no white pixel (greyscale)"
    if not mask.any():
        raise InvalidRequestError(
            f"{param} marks nothing to edit: it has {how}. Mark the region to edit with fully "
            "transparent pixels (OpenAI's PNG with alpha) or white on black (greyscale)",
            param=param,
            code="invalid_image",
        )
    return mask
