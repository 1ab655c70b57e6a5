"""The multi-core PNG encoder: any decoder reads back the exact pixels, each row's filter is the
adaptive choice, and the files are as small as PIL's at the same level."""

from __future__ import annotations

import io
import zlib

import numpy as np
import pytest
from PIL import Image

from vllm_omni_like import png
from vllm_omni_like.media import encode_image
from vllm_omni_like.png import MIN_PIXELS, encode_png, filter_rows, strips_for


def _decode(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)))


def _photo_like(height: int, width: int, channels: int, seed: int = 0) -> np.ndarray:
    """Smooth gradients with some noise: what filters and deflate meet in served images."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    planes = [(xx * (c + 1) + yy * (3 - c)) // 3 for c in range(channels)]
    base = np.stack(planes, -1).astype(np.int32) + rng.integers(-6, 7, (height, width, channels))
    return np.clip(base, 0, 255).astype(np.uint8)


@pytest.mark.parametrize("channels", [1, 2, 3, 4])
@pytest.mark.parametrize("strips", [1, 3, 7])
def test_pixels_come_back_exactly(channels: int, strips: int) -> None:
    pixels = _photo_like(45, 29, channels, seed=channels)
    got = _decode(encode_png(pixels[..., 0] if channels == 1 else pixels, 6, strips))
    want = pixels[..., 0] if channels == 1 else pixels
    assert got.shape == want.shape
    assert np.array_equal(got, want)


@pytest.mark.parametrize("level", [0, 1, 6, 9])
def test_every_level_decodes_and_higher_compresses_more(level: int) -> None:
    pixels = _photo_like(64, 80, 3)
    data = encode_png(pixels, level, strips=4)
    assert np.array_equal(_decode(data), pixels)
    if level:
        assert len(data) < len(encode_png(pixels, 0, strips=4))


def _reference_filter(rows: np.ndarray, bpp: int) -> np.ndarray:
    """PNG's adaptive filtering written out byte by byte (the specification's formulas)."""
    out = []
    prev = np.zeros(rows.shape[1], dtype=np.int64)
    for row in rows.astype(np.int64):
        options = []
        for kind in range(5):
            line = []
            for i, x in enumerate(row):
                a = row[i - bpp] if i >= bpp else 0
                b = prev[i]
                c = prev[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                paeth = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                pred = (0, a, b, (a + b) // 2, paeth)[kind]
                line.append((x - pred) % 256)
            options.append(line)
        costs = [sum(v if v < 128 else 256 - v for v in line) for line in options]
        kind = int(np.argmin(costs))
        out.append([kind, *options[kind]])
        prev = row
    return np.array(out, dtype=np.uint8)


def test_filters_match_the_specification() -> None:
    pixels = _photo_like(9, 7, 3, seed=5)
    rows = pixels.reshape(9, 21)
    want = _reference_filter(rows, 3)
    assert np.array_equal(filter_rows(rows, None, 3), want)
    # a strip starting mid-image filters against the row above it
    assert np.array_equal(filter_rows(rows[4:], rows[3], 3)[1:], want[5:])
    assert set(want[:, 0]) > {0}  # the picture makes more than one filter win


def test_as_small_as_pil_and_one_zlib_stream() -> None:
    pixels = _photo_like(256, 256, 3, seed=2)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=6)
    ours = encode_png(pixels, 6, strips=8)
    assert len(ours) <= 1.02 * len(buf.getvalue())
    # the IDAT payload is one zlib stream (header, strips, Adler-32) that zlib accepts whole
    start = ours.index(b"IDAT") + 4
    length = int.from_bytes(ours[start - 8 : start - 4], "big")
    raw = zlib.decompress(ours[start : start + length])
    assert len(raw) == 256 * (1 + 256 * 3)


def test_encode_image_takes_the_strips_for_large_images() -> None:
    side = int(MIN_PIXELS**0.5)
    assert strips_for(side, side) > 1 and strips_for(side // 2, side // 2) == 1
    pixels = _photo_like(side, side, 3, seed=3)
    data = encode_image(pixels, "png")
    assert data == encode_png(pixels, 6)  # (deterministic: the same bytes every time)
    assert np.array_equal(_decode(data), pixels)
    low = encode_image(pixels, "png", compression=0)  # output_compression 0: level 0
    assert np.array_equal(_decode(low), pixels) and len(low) > len(data)


def test_a_large_image_takes_pil_while_another_encode_holds_the_pool() -> None:
    side = int(MIN_PIXELS**0.5)
    pixels = _photo_like(side, side, 3, seed=4)
    with png.claim() as first:  # (another image on the pool meanwhile)
        assert first
        with png.claim() as second:
            assert not second
        beside = encode_image(pixels, "png")
    alone = encode_image(pixels, "png")  # the pool free again
    assert alone == encode_png(pixels, 6) and beside != alone
    assert np.array_equal(_decode(beside), pixels) and np.array_equal(_decode(alone), pixels)
    with png.claim() as again:  # released after each use
        assert again


@pytest.mark.parametrize("sizes", [(0, 5), (1, 1), (70_000, 3), (5, 200_000), (131_073, 65_521)])
def test_adler32_combines_as_zlib_reads_the_concatenation(sizes: tuple[int, int]) -> None:
    rng = np.random.default_rng(sum(sizes))
    first, second = (rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes)
    combined = png.adler32_combine(zlib.adler32(first), zlib.adler32(second), len(second))
    assert combined == zlib.adler32(first + second)


def test_rows_filtered_elsewhere_make_the_same_file() -> None:
    """A GPU stage's filtered rows (`scanlines`) leave only deflate: the same bytes as the
    encoder filtering them itself; in the calling thread (no pool), one deflate stream that
    decodes to the pixels."""
    pixels = _photo_like(300, 1000, 3, seed=5)  # over MIN_PIXELS: strips on the pool
    scanlines = filter_rows(pixels.reshape(300, -1), None, 3)
    assert encode_png(pixels, 6, scanlines=scanlines) == encode_png(pixels, 6)
    alone = encode_png(pixels, 6, scanlines=scanlines, pool=False)
    assert np.array_equal(_decode(alone), pixels)


def test_scanlines_of_another_shape_are_refused() -> None:
    pixels = _photo_like(20, 30, 3)
    with pytest.raises(ValueError, match="not those of"):
        encode_png(pixels, 6, scanlines=np.zeros((20, 30 * 3), np.uint8))


def test_a_held_pool_leaves_given_scanlines_to_deflate_in_the_callers_thread() -> None:
    """Beside another encode (the pool held), an image with filtered rows is deflated from
    them in the caller's thread, not handed to PIL: what is deflated is what was given."""
    pixels = _photo_like(600, 500, 3, seed=1)
    other = _photo_like(600, 500, 3, seed=2)
    scanlines = filter_rows(other.reshape(600, -1), None, 3)
    with png.claim() as held:
        assert held
        data = encode_image(pixels, "png", None, scanlines)
    assert np.array_equal(_decode(data), other)  # (the rows given, not the pixels', were used)
