"""The server against plain diffusers, in the same run (docs/benchmarks.md).

    python bench/serving.py --compile both --video          # on a GPU machine

Images (SD1.5 architecture, random weights, 512x512, 30 DDIM steps, CFG 7.5): the plain-diffusers
reference runs first in this process (batch-1 latency and the best img/s over batch sizes), then
`vllm-omni-like serve sd15 --load-format dummy` starts as its own process and closed-loop HTTP
clients drive it at concurrency 1, 8 and 32. Both sides produce PNG bytes; the server's images
must equal the reference's at the same seed (PSNR >= 35 dB). The same for each compile setting.
Video (Wan2.1-T2V-1.3B architecture, 832x480, 33 frames, 20 steps, CFG 5): the reference's MP4
against `/v1/videos` create -> poll at 50 ms -> content.
Results: bench/results/serving-<device>.json and video-<device>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import raw_diffusers as ref
from cli_flags import add_outputs, parser
from compare import PSNR_MIN_DB, db, psnr
from control_plane import pct
from PIL import Image
from server_proc import Server
from serving_video import video_bench


# ---- images ---------------------------------------------------------------------------------
def image_body(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    return {
        "prompt": ref.PROMPT,
        "size": f"{args.size}x{args.size}",
        "seed": seed,
        "num_inference_steps": args.steps,
        "guidance_scale": args.guidance,
        "response_format": "b64_json",
        "output_format": getattr(args, "output_format", "png"),  # (host_cap.py asks for others)
    }


def check_ok(r: httpx.Response) -> None:
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")


def first_image(r: httpx.Response) -> np.ndarray:
    """The response's first image, decoded to RGB pixels."""
    png = base64.b64decode(r.json()["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


async def closed_loop(
    url: str, args: argparse.Namespace, concurrency: int, total: int, keep: int
) -> tuple[list[float], float, dict[int, np.ndarray]]:
    """`concurrency` clients, each sending its next request when the last one came back."""
    latencies: list[float] = []
    kept: dict[int, np.ndarray] = {}
    counter = iter(range(total))

    async def client(http: httpx.AsyncClient) -> None:
        for seed in counter:
            t0 = time.perf_counter()
            r = await http.post("/v1/images/generations", json=image_body(args, seed))
            latencies.append(time.perf_counter() - t0)
            check_ok(r)
            if seed < keep:
                kept[seed] = first_image(r)

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        return latencies, time.perf_counter() - t0, kept


def sd15_flags(args: argparse.Namespace, max_batch: int) -> list[str]:
    """`serve` flags of the SD1.5 benchmark server: random weights, the workload's size warmed
    up, no admission limit a closed loop could hit, no stall kill during a long warm-up."""
    return [
        "sd15",
        "--load-format",
        "dummy",
        "--dtype",
        args.dtype,
        "--max-batch-size",
        str(max_batch),
        "--max-queue-size",
        "4096",
        "--max-queue-seconds",
        "0",
        "--stall-timeout",
        "600",
        "--warmup-size",
        f"{args.size}x{args.size}",
    ]


def serve_images(
    args: argparse.Namespace,
    compiled: bool,
    log: str,
    on_level: Callable[[dict[str, Any], dict[str, dict[int, np.ndarray]]], None],
    reference_bs1: Callable[[int], float] | None = None,
) -> None:
    """Start the server and measure each concurrency level; `on_level` gets what is there.

    With `reference_bs1` (the reference's batch-1 call, in this process), concurrency 1
    alternates reference and server requests, so a drifting host slows both sides alike.
    """
    flags = sd15_flags(args, max(args.concurrency))
    if compiled:
        flags += ["--compile", "--batch-buckets", args.batch_buckets]
    flags += args.server_flags.split()
    server = Server(flags, log, timeout=1800)
    out: dict[str, Any] = {"start_s": round(server.start_s, 1)}
    images: dict[str, dict[int, np.ndarray]] = {}
    try:
        # warm-up: every concurrency level once (cudnn autotuning, allocator, batch shapes)
        for c in args.concurrency:
            asyncio.run(closed_loop(server.url, args, c, c, 0))
        for c in args.concurrency:
            total = args.latency_runs if c == 1 else c * args.rounds
            if c == 1 and reference_bs1 is not None:
                lat, wall, images["c1"], ref_lat = interleaved(server.url, args, reference_bs1)
            else:
                lat, wall, images[f"c{c}"] = asyncio.run(
                    closed_loop(server.url, args, c, total, args.keep)
                )
            out[f"c{c}"] = {
                "requests": total,
                "img_s": round(total / wall, 3),
                "latency_p50_s": round(pct(lat, 0.5), 4),
                "latency_p99_s": round(pct(lat, 0.99), 4),
            }
            if c == 1 and reference_bs1 is not None:
                out["c1"]["reference_interleaved_latency_p50_s"] = round(pct(ref_lat, 0.5), 4)
            print(
                f"server {'compile' if compiled else 'eager'} c{c}: {out[f'c{c}']['img_s']} "
                f"img/s, p50 {out[f'c{c}']['latency_p50_s']} s",
                file=sys.stderr,
            )
            on_level(out, images)  # saved level by level: a cut-off run keeps what it measured
    finally:
        server.stop()


def interleaved(
    url: str, args: argparse.Namespace, reference_bs1: Callable[[int], float]
) -> tuple[list[float], float, dict[int, np.ndarray], list[float]]:
    """Concurrency 1 as reference call, server request, reference call, ... (same seeds)."""
    lat, ref_lat, kept = [], [], {}
    with httpx.Client(base_url=url, timeout=900) as http:
        for seed in range(args.latency_runs):
            ref_lat.append(reference_bs1(seed))
            t0 = time.perf_counter()
            r = http.post("/v1/images/generations", json=image_body(args, seed))
            lat.append(time.perf_counter() - t0)
            check_ok(r)
            if seed < args.keep:
                kept[seed] = first_image(r)
    return lat, sum(lat), kept, ref_lat  # the server's wall time: its requests only


def _reference_paths(args: argparse.Namespace, label: str) -> tuple[str, str]:
    name = f"reference-{label}-{ref.device_name()}"
    base = os.path.join(args.reference_dir or args.out_dir, name)
    return base + ".json", base + ".npz"


def run_reference(
    args: argparse.Namespace, pipe: Any, compiled: bool, label: str
) -> dict[str, Any]:
    """Plain diffusers in this process; figures and the images by seed are kept on disk."""
    sizes = args.ref_compile_batch_sizes if compiled else args.ref_batch_sizes
    reference = ref.image_reference(pipe, args, [int(b) for b in sizes.split(",")], label)
    figures, npz = _reference_paths(args, label)
    with open(figures, "w") as f:
        json.dump({k: v for k, v in reference.items() if k != "images"}, f, indent=2)
    np.savez_compressed(npz, **{str(seed): img for seed, img in reference["images"].items()})
    return reference


def load_reference(args: argparse.Namespace, label: str) -> dict[str, Any]:
    figures, npz = _reference_paths(args, label)
    with open(figures) as f:
        reference = json.load(f)
    with np.load(npz) as data:
        reference["images"] = {int(seed): data[seed] for seed in data.files}
    return reference


def reference_latency(reference: dict[str, Any], c1: dict[str, Any]) -> float:
    """The reference's batch-1 latency: the one measured alternately with the server's c1
    requests where there is one, else the reference's own run."""
    return c1.get("reference_interleaved_latency_p50_s", reference["bs1_latency_s"])


def summarize(
    reference: dict[str, Any],
    served: dict[str, Any],
    images: dict[str, dict[int, np.ndarray]],
    label: str,
) -> dict[str, Any]:
    served = {k: dict(v) if isinstance(v, dict) else v for k, v in served.items()}
    c1 = served.get("c1", {})
    psnrs = []
    for level, kept in images.items():
        values = [psnr(img, reference["images"][s]) for s, img in kept.items()]
        served[level]["psnr_min_db"] = db(min(values)) if values else None
        psnrs += values
    return {
        "reference": {k: v for k, v in reference.items() if k != "images"},
        "server": served,
        "latency_ratio": (
            round(c1["latency_p50_s"] / reference_latency(reference, c1), 4) if c1 else None
        ),
        "psnr_min_db": db(min(psnrs)) if psnrs else None,
        "images_equal": bool(psnrs) and min(psnrs) >= PSNR_MIN_DB,
        "label": label,
    }


def image_setting(
    args: argparse.Namespace,
    compiled: bool,
    log: str,
    save: Callable[[dict[str, Any]], None],
) -> None:
    """The reference (run now, or read from an earlier phase), then the server, level by level."""
    label = "compile" if compiled else "eager"
    pipe = None
    if args.phase == "server":
        reference = load_reference(args, label)
    else:
        device = "cuda" if ref.torch.cuda.is_available() else "cpu"
        pipe = ref.build("sd15", args.dtype, device, compile_unet=compiled)
        reference = run_reference(args, pipe, compiled, label)
    try:
        if args.phase == "reference":
            return

        def reference_bs1(seed: int) -> float:
            return ref.images(pipe, [seed], args.steps, args.size, args.guidance)[2]

        serve_images(
            args,
            compiled,
            log,
            lambda served, images: save(summarize(reference, served, images, label)),
            reference_bs1 if pipe is not None else None,
        )
    finally:
        pipe = None  # the reference's GPU memory goes back before the next setting
        ref.free()


# ---- report ---------------------------------------------------------------------------------
def headline(settings: dict[str, Any], device: str) -> dict[str, Any]:
    eager = settings.get("eager") or next(iter(settings.values()))
    eager_c1 = eager["server"].get("c1", {})
    best_ref = max(max(s["reference"]["img_s"].values()) for s in settings.values())
    best_c32 = max(settings.values(), key=lambda s: s["server"].get("c32", {}).get("img_s", 0))
    return {
        "device": device,
        "gpu": ref.gpu_name(),
        "reference_bs1_latency_s": round(reference_latency(eager["reference"], eager_c1), 4),
        "server_c1_latency_p50_s": eager_c1.get("latency_p50_s"),
        "latency_ratio_same_compile_setting": {k: s["latency_ratio"] for k, s in settings.items()},
        "reference_best_img_s": best_ref,
        "server_c32_img_s": best_c32["server"].get("c32", {}).get("img_s"),
        "server_c32_setting": best_c32["label"],
        "throughput_ratio": round(best_c32["server"].get("c32", {}).get("img_s", 0) / best_ref, 3),
        "images_equal": all(s["images_equal"] for s in settings.values()),
        **settings,
    }


def main() -> int:
    ap = parser(__doc__)
    ref.add_image_args(ap)
    ap.add_argument("--compile", choices=("off", "on", "both"), default="both")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3, help="requests per client at c > 1")
    ap.add_argument("--keep", type=int, default=8, help="seeds whose images are compared")
    ap.add_argument("--ref-batch-sizes", default="1,2,4,8,16,32")
    ap.add_argument("--ref-compile-batch-sizes", default="1,8,32")
    ap.add_argument("--batch-buckets", default="1,8,32", help="the server's compiled buckets")
    ap.add_argument("--images", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--video", action="store_true")
    ap.add_argument("--video-dtype", default="bf16")
    ap.add_argument("--video-runs", type=int, default=2)
    ap.add_argument("--server-flags", default="", help="more `serve` flags for the images")
    ap.add_argument("--video-server-flags", default="", help="more `serve` flags for the video")
    ap.add_argument("--video-size", help="WxH (default 832x480); smaller only for smoke runs")
    ap.add_argument("--video-frames", type=int)
    ap.add_argument("--video-steps", type=int)
    add_outputs(ap)
    ap.add_argument(
        "--phase",
        choices=("all", "reference", "server"),
        default="all",
        help="reference: plain diffusers only (figures and images saved to --out-dir); "
        "server: the server against a saved reference (--reference-dir); all: both",
    )
    ap.add_argument("--reference-dir", help="where a reference phase saved its files")
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.keep = min(args.keep, args.latency_runs)
    os.makedirs(args.out_dir, exist_ok=True)
    device = ref.device_name()
    log = os.path.join(args.out_dir, f"serving-{device}.log")
    if args.images:
        modes = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
        path = os.path.join(args.out_dir, f"serving-{device}.json")
        settings: dict[str, Any] = {}
        if os.path.exists(path):  # keep the other compile setting of an earlier run
            with open(path) as f:
                earlier = json.load(f)
            settings = {k: earlier[k] for k in ("eager", "compile") if k in earlier}

        def save(found: dict[str, Any]) -> None:
            settings[found["label"]] = found
            with open(path, "w") as f:
                json.dump(headline(settings, device), f, indent=2)

        for compiled in modes:
            image_setting(args, compiled, log, save)
        if settings:
            report = headline(settings, device)
            print(json.dumps({k: v for k, v in report.items() if k not in settings}, indent=2))
    if args.video:
        report = video_bench(args, log)
        with open(os.path.join(args.out_dir, f"video-{device}.json"), "w") as f:
            json.dump(report, f, indent=2)
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
