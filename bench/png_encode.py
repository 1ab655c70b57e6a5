"""PNG encoding on the host: one image's latency and a burst's throughput against the size of
the strip pool (vllm_omni_like/png.py), beside PIL's encoder.

    python bench/png_encode.py --label 'H200 host, 16 cores'   # bench/results/png_encode.jsonl

For 512x512 and 1024x1024 noise images (what random weights decode to; the hardest case for
deflate), at the server's compression level: the median of 10 single encodes (the latency a
lone request pays after its decode) and 32 images encoded at once from 32 threads as the API's
worker threads do when a set's results come back together (images a second), for pool sizes
1, 4, 8, 16, 32 and the host's cores (up to 32), and the server's own choice (`encode_image`:
the pool while no other image holds it, PIL beside it). Each also with the rows filtered
already (`filtered_*`: what a GPU stage sends, png_rows.py), deflate alone left. Picks the
pool size by measurement.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from io import BytesIO
from typing import Any

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.cli_flags import add_outputs, parser
from vllm_omni_like import png
from vllm_omni_like.media import PNG_COMPRESS_LEVEL, encode_image


def single_ms(encode: Any, pixels: np.ndarray, runs: int = 10) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        encode(pixels)
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1000, 2)


def burst_img_s(encode: Any, pixels: np.ndarray, n: int = 32) -> float:
    with ThreadPoolExecutor(n) as callers:
        list(callers.map(lambda _: encode(pixels), range(n)))  # (warm)
        t0 = time.perf_counter()
        list(callers.map(lambda _: encode(pixels), range(n)))
        return round(n / (time.perf_counter() - t0), 1)


def pil(pixels: np.ndarray) -> bytes:
    buf = BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buf.getvalue()


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--label", default="", help="the machine, in words")
    add_outputs(ap)
    args = ap.parse_args()
    cores = os.cpu_count() or 1
    rng = np.random.default_rng(0)
    result: dict[str, Any] = {"machine": args.label or platform.node(), "cpus": cores}
    for side in (512, 1024):
        pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
        scanlines = png.filter_rows(pixels.reshape(side, -1), None, 3)

        def served(p: np.ndarray, scanlines: np.ndarray = scanlines) -> bytes:  # GPU-filtered rows
            return encode_image(p, "png", None, scanlines)

        row: dict[str, Any] = {
            "pil_single_ms": single_ms(pil, pixels),
            "pil_burst_img_s": burst_img_s(pil, pixels),
        }
        for threads in sorted({t for t in (1, 4, 8, 16, 32) if t <= cores} | {min(cores, 32)}):
            png._pool = ThreadPoolExecutor(threads, thread_name_prefix="png")

            def strips(p: np.ndarray) -> bytes:
                return png.encode_png(p, PNG_COMPRESS_LEVEL)

            def deflate_only(p: np.ndarray, scanlines: np.ndarray = scanlines) -> bytes:
                return png.encode_png(p, PNG_COMPRESS_LEVEL, scanlines=scanlines)

            row[f"pool_{threads}"] = {
                "single_ms": single_ms(strips, pixels),
                "burst_img_s": burst_img_s(strips, pixels),
                "filtered_single_ms": single_ms(deflate_only, pixels),
                "filtered_burst_img_s": burst_img_s(deflate_only, pixels),
            }
            png._pool.shutdown()
        png._pool = None  # the server's own choice: the pool while free, else PIL (media.py)
        row["encode_image"] = {
            "single_ms": single_ms(encode_image, pixels),
            "burst_img_s": burst_img_s(encode_image, pixels),
            "filtered_single_ms": single_ms(served, pixels),
            "filtered_burst_img_s": burst_img_s(served, pixels),
        }
        result[f"{side}x{side}"] = row
        print(side, json.dumps(row), flush=True)
    png._pool = None
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "png_encode.jsonl"), "a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
