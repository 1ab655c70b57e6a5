"""PNG encoding on several cores: the same format and compression level as PIL's, in strips.

A 1024x1024 image takes PIL's single-threaded encoder 0.15-0.25 s at level 6 (more for the
noisy images of random weights) - 4-6 % of a FLUX.1 request, all of it after the GPU is done.
Here the rows are split in strips of 32; each strip is filtered (PNG's adaptive filtering: for
each row, the one of the five filters whose output has the smallest sum of absolute signed
values, libpng's choice) and deflated with PIL's settings (Z_FILTERED, memLevel 9) on a pool of
up to `MAX_THREADS` threads (zlib and numpy leave the GIL), each strip's raw deflate stream
ending on a byte boundary (a sync flush) so that the strips concatenate into one zlib stream, whose
Adler-32 covers all of them. Any PNG decoder reads it; the pixels are the image's exactly, the
file a little smaller than PIL's (PIL leaves out the Average filter).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import struct
import threading
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

MIN_PIXELS = 512 * 512  # smaller images: PIL's encoder (media.py), one strip
STRIP_ROWS = 32  # strips this small also keep each one's filtering within the CPU's cache
# measured (bench/png_encode.py, H200 host, 16 cores): a 1024x1024 image 39.4 ms on 8 threads,
# 36.4 on 16; a burst of 32 from 32 threads 30.5 images a second on 8, 25.7 on 16
MAX_THREADS = 8
_COLOR_TYPES = {1: 0, 2: 4, 3: 2, 4: 6}  # channels -> PNG colour type (L, LA, RGB, RGBA)
_pool: ThreadPoolExecutor | None = None
_held = threading.Lock()  # held by the encode on the pool


@contextlib.contextmanager
def claim() -> Iterator[bool]:
    """Whether the caller may encode on the strip pool: yes while no other encode holds it. A
    lone image takes the pool (1024x1024 in 39 ms against PIL's 222 on the H200 host); the
    images of a burst beside it take PIL's one-core encoder in their own threads, which
    together outrun the pool there (50.8 against 30.5 images a second from 32 threads;
    bench/results/png_encode.jsonl)."""
    got = _held.acquire(blocking=False)
    try:
        yield got
    finally:
        if got:
            _held.release()


def strips_for(height: int, width: int) -> int:
    """How many strips an image of this size is encoded in (1: not worth sharing)."""
    if height * width < MIN_PIXELS:
        return 1
    return max(1, height // STRIP_ROWS)


def encode_png(pixels: np.ndarray, level: int = 6, strips: int | None = None) -> bytes:
    """`pixels`: (H, W) or (H, W, C) uint8, C in 1-4."""
    image = np.ascontiguousarray(pixels, dtype=np.uint8)
    if image.ndim == 2:
        image = image[:, :, None]
    height, width, channels = image.shape
    rows = image.reshape(height, width * channels)
    count = strips or strips_for(height, width)
    bounds = np.linspace(0, height, count + 1).astype(int)
    spans = [(int(a), int(b)) for a, b in itertools.pairwise(bounds) if b > a]

    def strip(i: int) -> tuple[bytes, bytes]:
        start, stop = spans[i]
        above = rows[start - 1] if start else None
        data = filter_rows(rows[start:stop], above, channels).tobytes()
        deflate = zlib.compressobj(level, zlib.DEFLATED, -15, 9, zlib.Z_FILTERED)  # as PIL
        last = i == len(spans) - 1
        body = deflate.compress(data) + deflate.flush(zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH)
        return data, body

    many = len(spans) > 1
    parts = list(_executor().map(strip, range(len(spans)))) if many else [strip(0)]
    adler = 1
    for data, _ in parts:
        adler = zlib.adler32(data, adler)
    stream = zlib.compress(b"", level)[:2] + b"".join(b for _, b in parts)
    stream += struct.pack(">I", adler)
    header = struct.pack(">IIBBBBB", width, height, 8, _COLOR_TYPES[channels], 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", stream)
        + _chunk(b"IEND", b"")
    )


def filter_rows(rows: np.ndarray, above: np.ndarray | None, bpp: int) -> np.ndarray:
    """Each row with its filter-type byte first, filtered by the adaptive choice (`above`: the
    row before the first, unfiltered; None at the image's top)."""
    x = rows.astype(np.int16)
    up = np.empty_like(x)
    up[0] = 0 if above is None else above
    up[1:] = x[:-1]
    left = np.zeros_like(x)
    left[:, bpp:] = x[:, :-bpp]
    corner = np.zeros_like(x)
    corner[:, bpp:] = up[:, :-bpp]
    # Paeth: the one of left, up, corner nearest to left + up - corner (ties in that order)
    pa, pb, pc = np.abs(up - corner), np.abs(left - corner), np.abs(left + up - 2 * corner)
    paeth = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, up, corner))
    candidates = np.stack([x, x - left, x - up, x - ((left + up) >> 1), x - paeth]).astype(
        np.uint8
    )  # (5, rows, bytes), modulo 256
    signed = candidates.view(np.int8).astype(np.int16)
    cost = np.abs(signed).sum(axis=2, dtype=np.int64)  # (5, rows)
    choice = cost.argmin(axis=0)
    out = np.empty((x.shape[0], x.shape[1] + 1), dtype=np.uint8)
    out[:, 0] = choice
    out[:, 1:] = candidates[choice, np.arange(x.shape[0])]
    return out


def _chunk(kind: bytes, data: bytes) -> bytes:
    crc = zlib.crc32(data, zlib.crc32(kind))
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(min(MAX_THREADS, os.cpu_count() or 1), thread_name_prefix="png")
    return _pool
