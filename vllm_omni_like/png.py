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
from typing import Any

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


def encode_png(
    pixels: np.ndarray,
    level: int = 6,
    strips: int | None = None,
    scanlines: np.ndarray | None = None,
    pool: bool = True,
) -> bytes:
    """`pixels`: (H, W) or (H, W, C) uint8, C in 1-4. `scanlines`: the same image's rows
    already filtered (H, 1 + W * C: `filter_rows`'s output, as a GPU stage makes it beside the
    pixels), so that only deflate is left here: zlib leaves the GIL for all of it, where the
    filter's many numpy calls each take it back (on the H200 host, 8 threads filter a 1024x1024
    image in 20.4 ms against 61.7 on one, and deflate it in 14.5 against 96.6). `pool`: False
    encodes in the calling thread."""
    image = np.ascontiguousarray(pixels, dtype=np.uint8)
    if image.ndim == 2:
        image = image[:, :, None]
    height, width, channels = image.shape
    rows = image.reshape(height, width * channels)
    if scanlines is not None and scanlines.shape != (height, width * channels + 1):
        raise ValueError(f"scanlines {scanlines.shape} are not those of a {image.shape} image")
    count = strips or (strips_for(height, width) if pool else 1)
    bounds = np.linspace(0, height, count + 1).astype(int)
    spans = [(int(a), int(b)) for a, b in itertools.pairwise(bounds) if b > a]

    def strip(i: int) -> tuple[int, int, bytes]:
        """(the strip's filtered bytes' Adler-32 and length, its raw deflate stream)."""
        start, stop = spans[i]
        if scanlines is not None:
            data: Any = np.ascontiguousarray(scanlines[start:stop]).reshape(-1).data
        else:
            above = rows[start - 1] if start else None
            data = filter_rows(rows[start:stop], above, channels).tobytes()
        deflate = zlib.compressobj(level, zlib.DEFLATED, -15, 9, zlib.Z_FILTERED)  # as PIL
        last = i == len(spans) - 1
        body = deflate.compress(data) + deflate.flush(zlib.Z_FINISH if last else zlib.Z_SYNC_FLUSH)
        return zlib.adler32(data), len(data), body

    many = pool and len(spans) > 1
    run = _executor().map if many else map
    return _png_file(width, height, channels, level, list(run(strip, range(len(spans)))))


def _png_file(
    width: int, height: int, channels: int, level: int, parts: list[tuple[int, int, bytes]]
) -> bytes:
    """The file from its strips' (Adler-32, length, raw deflate stream): the zlib stream's
    header, the strips, the Adler-32 of all of them; its CRC taken over the pieces in turn, so
    that no copy of the stream is made before the file's one join."""
    adler = 1
    for value, length, _ in parts:
        adler = adler32_combine(adler, value, length)
    header = struct.pack(">IIBBBBB", width, height, 8, _COLOR_TYPES[channels], 0, 0, 0)
    idat = [zlib.compress(b"", level)[:2], *(body for _, _, body in parts)]
    idat.append(struct.pack(">I", adler))
    crc = zlib.crc32(b"IDAT")
    for piece in idat:
        crc = zlib.crc32(piece, crc)
    size = sum(len(piece) for piece in idat)
    head = [b"\x89PNG\r\n\x1a\n", _chunk(b"IHDR", header), struct.pack(">I", size) + b"IDAT"]
    return b"".join([*head, *idat, struct.pack(">I", crc), _chunk(b"IEND", b"")])


def adler32_combine(first: int, second: int, length: int) -> int:
    """The Adler-32 of two byte strings one after the other, from each one's (`second`'s
    `length` bytes): A = A1 + A2 - 1 and B = B1 + B2 + length * (A1 - 1), modulo 65521."""
    mod = 65521
    a1, b1, a2, b2 = first & 0xFFFF, first >> 16, second & 0xFFFF, second >> 16
    a = (a1 + a2 - 1) % mod
    b = (b1 + b2 + length * (a1 - 1)) % mod
    return (b << 16) | a


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
