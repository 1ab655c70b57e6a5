"""Today's video models through `/v1/videos` against plain diffusers compiled, one video (#39).

    python bench/video_models.py --model wan2.2-ti2v-5b --parts reference   # one GPU call
    python bench/video_models.py --model wan2.2-ti2v-5b --parts server      # the next
    python bench/video_models.py --model /tmp/tiny-wan22-ti2v --dtype fp32  # a CPU smoke run

The model's published settings (its architecture's options: Wan2.2-TI2V-5B 1280x704, 121
frames at 24 fps, 50 steps, CFG 5), bf16, random weights (`--load-format dummy`'s seeded recipe)
and the same seeded random prompt embeddings on both sides (the architectures ship no UMT5).
A full 50-step video does not fit the reference's call beside its compile, so both sides run
`--timed-steps` (8) and are extrapolated alike: the whole video at 8 steps (text, steps,
decode, MP4 on the reference's side; create -> poll at 50 ms -> content on the server's), plus
the remaining steps at the median step on the device (CUDA events at each step's end; the
server's from its step timeline). `extrapolated: true` says so.
- reference: WanPipeline compiled at its best: the transformer(s) under
  `torch.compile(fullgraph=True, dynamic=False)` (the VAE decoder eager, as the server runs it:
  fullgraph stops at its feature cache), fused QKV where diffusers offers it, the
  fastest of diffusers' attention backends (each timed for two steps); its frames kept in
  `--state` for the comparison.
- server: `serve <model> --load-format dummy --dtype bf16 --compile`, the same request.
Writes `bench/results/video_models-<device>.json`: `device`, `models.<name>` with `server_s`,
`diffusers_compiled_s`, `ratio_vs_compiled`, `psnr_db` (the server's MP4 against the
reference's), `videos_equal` (>= 35 dB, or the server's MP4 as close to the reference's frames
as the reference's own MP4 is, within 0.5 dB: what H.264 loses), `extrapolated`, and each
side's step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import httpx
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import reference_state
from bench.cli_flags import add_compile_mode, add_dtype, add_model, add_outputs, parser
from bench.compare import psnr
from bench.models import ATTENTION, write
from bench.raw_diffusers import DTYPES, PROMPT, free, sync
from bench.server_proc import Server, make_video
from bench.step_profile import step_timeline
from vllm_omni_like.pipelines.catalog import ARCH_OPTIONS, arch_path
from vllm_omni_like.stages.diffusion.prompt_embeds import random_prompt_embeds
from vllm_omni_like.stages.torch_utils import dummy_pipeline
from vllm_omni_like.stages.trace import TRACE_BATCHES_ENV, TRACE_DIR_ENV
from vllm_omni_like.video_codec import decode_video, encode_video


def settings(args: argparse.Namespace) -> dict[str, Any]:
    opts = ARCH_OPTIONS.get(args.model, {})
    s = {
        "width": opts.get("default_width", 64),
        "height": opts.get("default_height", 64),
        "frames": opts.get("default_frames", 5),
        "fps": opts.get("default_fps", 16),
        "steps": opts.get("default_steps", 4),
        "guidance": opts.get("default_guidance", 5.0),
        "text_tokens": opts.get("max_sequence_length", 512),
    }
    if args.size:
        s["width"], s["height"] = map(int, args.size.split("x"))
    for key in ("frames", "steps"):
        if getattr(args, key):
            s[key] = getattr(args, key)
    s["timed_steps"] = min(args.timed_steps, s["steps"])
    return s


def video(pipe: Any, s: dict[str, Any], steps: int) -> tuple[np.ndarray, bytes, float, list]:
    """One video as a diffusers user makes it, and its MP4: (frames, mp4, seconds, the steps'
    durations on the device from the second step's end)."""
    device, dtype = pipe.device, pipe.transformer.dtype
    dim, marks = pipe.transformer.config.text_dim, []

    def on_step_end(pipe: Any, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        if device.type == "cuda":
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[-1].record()
        else:  # (the CPU: the host's clock is the device's)
            marks.append(time.perf_counter())
        return kwargs

    def elapsed(a: Any, b: Any) -> float:
        return 1000 * (b - a) if isinstance(a, float) else float(a.elapsed_time(b))

    sync()
    t0 = time.perf_counter()
    frames = pipe(
        prompt_embeds=random_prompt_embeds([PROMPT], s["text_tokens"], dim, dtype, device),
        negative_prompt_embeds=random_prompt_embeds([""], s["text_tokens"], dim, dtype, device),
        num_frames=s["frames"],
        height=s["height"],
        width=s["width"],
        num_inference_steps=steps,
        guidance_scale=s["guidance"],
        generator=torch.Generator(device=device).manual_seed(0),
        output_type="np",
        callback_on_step_end=on_step_end,
    ).frames[0]
    pixels = (frames * 255).round().astype(np.uint8)
    mp4 = encode_video(pixels, s["fps"])
    seconds = time.perf_counter() - t0
    return pixels, mp4, seconds, [elapsed(a, b) for a, b in itertools.pairwise(marks)]


def fastest_attention(pipe: Any, s: dict[str, Any]) -> str:
    best, name = float("inf"), "native"
    for backend in ATTENTION:
        try:
            for model in experts(pipe):
                model.set_attention_backend(backend)
            seconds = min(two_steps(pipe, s) for _ in range(2))
        except Exception as exc:  # not installed, not for this GPU or these shapes
            print(f"attention {backend}: {type(exc).__name__}", file=sys.stderr)
            continue
        print(f"attention {backend}: {seconds:.3f} s for two steps", file=sys.stderr)
        if seconds < best:
            best, name = seconds, backend
    for model in experts(pipe):
        model.set_attention_backend(name)
    return name


def two_steps(pipe: Any, s: dict[str, Any]) -> float:
    """Seconds for two steps at the video's shape, without the decode (the backends' race)."""
    device, dtype = pipe.device, pipe.transformer.dtype
    dim = pipe.transformer.config.text_dim
    sync()
    t0 = time.perf_counter()
    pipe(
        prompt_embeds=random_prompt_embeds([PROMPT], s["text_tokens"], dim, dtype, device),
        negative_prompt_embeds=random_prompt_embeds([""], s["text_tokens"], dim, dtype, device),
        num_frames=s["frames"],
        height=s["height"],
        width=s["width"],
        num_inference_steps=2,
        guidance_scale=s["guidance"],
        output_type="latent",
    )
    sync()
    return time.perf_counter() - t0


def experts(pipe: Any) -> list[Any]:
    return [m for m in (pipe.transformer, getattr(pipe, "transformer_2", None)) if m is not None]


def part_reference(args: argparse.Namespace, s: dict[str, Any]) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = arch_path(args.model) if args.model in ARCH_OPTIONS else args.model
    pipe = dummy_pipeline(path, device, DTYPES[args.dtype]).to(device)
    pipe.set_progress_bar_config(disable=True)
    result: dict[str, Any] = {}
    # (a CPU smoke run over a tiny directory takes this same path: what a GPU sitting runs)
    result["attention"] = fastest_attention(pipe, s)
    options = {"fullgraph": True, "dynamic": False, "mode": args.compile_mode}
    for name in ("transformer", "transformer_2"):
        model = getattr(pipe, name, None)
        if model is None:
            continue
        if hasattr(model, "fuse_qkv_projections"):
            model.fuse_qkv_projections()
        setattr(pipe, name, torch.compile(model, **options))
    # The Wan VAE decoder stays eager, as the server leaves it: under fullgraph dynamo stops at
    # its feature cache's `feat_cache[idx] == "Rep"` (a tensor compared with a string: the
    # TI2V reference crashed there after 155 s on an H100), and without fullgraph it breaks
    # there once a frame, a graph a chunk, for a decode that is not the step under comparison
    result["vae_decoder"] = "eager (fullgraph fails at the feature cache's string check)"
    video(pipe, s, s["timed_steps"])  # warm-up (compiles)
    runs = [video(pipe, s, s["timed_steps"]) for _ in range(args.runs)]
    frames, mp4 = runs[-1][0], runs[-1][1]
    at = statistics.median(r[2] for r in runs)
    steps = [ms for r in runs for ms in r[3]]
    step_ms = statistics.median(steps) if steps else 0.0
    result["diffusers_compiled_timed_s"] = round(at, 3)
    result["diffusers_compiled_step_ms"] = round(step_ms, 2)
    result["diffusers_compiled_s"] = round(at + (s["steps"] - s["timed_steps"]) * step_ms / 1000, 3)
    result["reference_mp4_psnr_db"] = round(psnr(decode_video(mp4), frames), 2)
    reference_state.save(args.state, {"frames": frames}, args.state_meta)
    with open(args.state + ".mp4", "wb") as f:
        f.write(mp4)
    del pipe
    free()
    return result


def part_server(args: argparse.Namespace, s: dict[str, Any]) -> dict[str, Any]:
    # another model's (or settings') reference is refused here, before the server starts
    ref = reference_state.load(args.state, args.state_meta)
    size = f"{s['width']}x{s['height']}"
    flags = [args.model, "--load-format", "dummy", "--dtype", args.dtype]
    flags += ["--max-side", str(max(s["width"], s["height"])), "--max-frames", str(s["frames"])]
    flags += ["--gpu-memory-fraction", "0.9"]
    flags += ["--compile", "--compile-mode", args.compile_mode, "--batch-buckets", "1"]
    flags += ["--warmup-size", size]
    timeline = tempfile.mkdtemp(prefix="video-timeline-")
    env = {**os.environ, TRACE_DIR_ENV: timeline, TRACE_BATCHES_ENV: ""}
    server = Server(flags, args.log, 1800, env=env)
    body = {
        "prompt": PROMPT,
        "size": size,
        "num_frames": s["frames"],
        "fps": s["fps"],
        "seed": 0,
        "num_inference_steps": s["timed_steps"],
        "guidance_scale": s["guidance"],
    }
    times, mp4, since = [], b"", float("inf")
    try:
        with httpx.Client(base_url=server.url, timeout=1800) as http:
            for run in range(1 + args.runs):  # (the first: a warm-up)
                t0 = time.perf_counter()
                mp4 = make_video(http, body)
                if run:
                    times.append(time.perf_counter() - t0)
                since = min(since, time.monotonic())
    finally:
        server.stop()
    at = statistics.median(times)
    step_ms = step_timeline(timeline, s["timed_steps"], since)["step_ms_by_rows"].get(1, 0.0)
    result: dict[str, Any] = {"server_timed_s": round(at, 3), "server_step_ms": step_ms}
    result["server_s"] = round(at + (s["steps"] - s["timed_steps"]) * step_ms / 1000, 3)
    result["server_start_s"] = round(server.start_s, 1)
    if ref is not None:  # H.264 is lossy: the MP4s, and each against the frames
        with open(args.state + ".mp4", "rb") as f:
            reference = decode_video(f.read())
        ours, frames = decode_video(mp4), ref["frames"]
        values = {"psnr_db": psnr(ours, reference), "psnr_vs_frames_db": psnr(ours, frames)}
        for key, value in values.items():
            result[key] = round(value, 2) if np.isfinite(value) else "inf"
        codec = psnr(reference, frames)  # what the codec loses on the reference's own frames
        result["videos_equal"] = bool(
            values["psnr_db"] >= 35 or values["psnr_vs_frames_db"] >= codec - 0.5
        )
    return result


def main() -> int:
    ap = parser(__doc__)
    add_model(ap, "wan2.2-ti2v-5b", "reference,server")
    add_dtype(ap, DTYPES, "bf16")
    ap.add_argument("--size", help="WxH (default: the model's)")
    ap.add_argument("--frames", type=int)
    ap.add_argument("--steps", type=int, help="the video's steps (default: the model's)")
    ap.add_argument("--timed-steps", type=int, default=8, help="steps each side runs")
    ap.add_argument("--runs", type=int, default=2)
    add_compile_mode(ap)
    ap.add_argument(
        "--state",
        help="the reference's frames (default: /tmp/video_models-reference-<model>"
        "[-<override>].npz, its MP4 beside it)",
    )
    add_outputs(ap, log="video_models.log")
    args = ap.parse_args()
    s = settings(args)
    name = os.path.basename(os.path.normpath(args.model))
    given = {"size": args.size, "frames": args.frames, "steps": args.steps}
    given |= {"timed": args.timed_steps if args.timed_steps != 8 else None}
    given |= {"dtype": None if args.dtype == "bf16" else args.dtype}
    args.state = reference_state.npz_path(
        args.state or reference_state.default_path("video_models", args.model, given)
    )
    args.state_meta = {"model": name, "dtype": args.dtype, **s}
    entry: dict[str, Any] = {**s, "dtype": args.dtype, "compile_mode": args.compile_mode}
    entry["extrapolated"] = s["timed_steps"] < s["steps"]
    for part in args.parts.split(","):
        entry.update((part_reference if part == "reference" else part_server)(args, s))
        print(json.dumps(write(name, entry, args.out_dir, "video_models")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
