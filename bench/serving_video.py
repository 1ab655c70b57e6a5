"""Wan-architecture video through `/v1/videos` against plain diffusers (serving.py --video).

Wan2.1-T2V-1.3B architecture (bf16, 832x480, 33 frames, 20 steps, CFG 5, the same seeded random
prompt embeddings on both sides): the reference's MP4 against create -> poll at 50 ms -> content.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import httpx
import numpy as np
import raw_diffusers as ref
from compare import PSNR_MIN_DB, db, psnr
from server_proc import Server, make_video

from vllm_omni_like.pipelines.catalog import ARCH_OPTIONS
from vllm_omni_like.video_codec import decode_video

CODEC_TOLERANCE_DB = 0.5  # MP4s: the server's as close to the reference frames as the reference's


def video_options(args: argparse.Namespace) -> dict[str, Any]:
    """Wan's benchmark settings; smaller ones only for a smoke run on a CPU."""
    opts = dict(ARCH_OPTIONS["wan2.1-t2v-1.3b"])
    if args.video_size:
        opts["default_width"], opts["default_height"] = map(int, args.video_size.split("x"))
    if args.video_frames:
        opts["default_frames"] = args.video_frames
    if args.video_steps:
        opts["default_steps"] = args.video_steps
    return opts


def serve_video(args: argparse.Namespace, log: str) -> tuple[float, bytes, float]:
    opts = video_options(args)
    flags = ["wan2.1-t2v-1.3b", "--load-format", "dummy", "--dtype", args.video_dtype]
    flags += args.video_server_flags.split()
    server = Server(flags, log, 1800)
    body = {
        "prompt": ref.PROMPT,
        "size": f"{opts['default_width']}x{opts['default_height']}",
        "num_frames": opts["default_frames"],
        "fps": 16,
        "seed": 0,
        "num_inference_steps": opts["default_steps"],
        "guidance_scale": opts["default_guidance"],
    }
    times, mp4 = [], b""
    try:
        with httpx.Client(base_url=server.url, timeout=900) as http:
            for run in range(1 + args.video_runs):  # the first one warms up
                t0 = time.perf_counter()
                mp4 = make_video(http, body)
                if run:
                    times.append(time.perf_counter() - t0)
    finally:
        server.stop()
    return float(np.median(times)), mp4, server.start_s


def video_bench(args: argparse.Namespace, log: str) -> dict[str, Any]:
    reference = ref.video_reference(args.video_dtype, args.video_runs, 16, video_options(args))
    server_s, mp4, _ = serve_video(args, log)
    a, b = (decode_video(data) for data in (reference["mp4"], mp4))
    same_shape = a.shape == b.shape == reference["frames"].shape
    value = psnr(a, b) if same_shape else -math.inf
    # H.264 is lossy: frames that differ by a rounding step can encode to MP4s further apart
    # than 35 dB. So the server's MP4 is also measured against the reference's own frames,
    # next to the reference's MP4 against the same frames (what the codec itself loses).
    codec = psnr(a, reference["frames"]) if same_shape else -math.inf
    server = psnr(b, reference["frames"]) if same_shape else -math.inf
    return {
        "device": ref.device_name(),
        "gpu": ref.gpu_name(),
        "settings": {**reference["settings"], "dtype": args.video_dtype, "fps": 16},
        "server_flags": args.video_server_flags,
        "reference_s": round(reference["seconds"], 3),
        "server_s": round(server_s, 3),
        "ratio": round(server_s / reference["seconds"], 4),
        "psnr_db": db(value),
        "psnr_reference_mp4_vs_reference_frames_db": db(codec),
        "psnr_server_mp4_vs_reference_frames_db": db(server),
        "reference_repeatable": reference["repeatable"],
        "videos_equal": value >= PSNR_MIN_DB or server >= codec - CODEC_TOLERANCE_DB,
        "frames": list(a.shape),
    }
