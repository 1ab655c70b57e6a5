"""CUDA graphs of the compiled forward against the compiled forward alone and plain diffusers (#59).

    python bench/graphs.py --parts reference                 # one GPU call a part (cold
    python bench/graphs.py --parts reference-ro              # compiles take minutes each)
    python bench/graphs.py --parts c1,c1-no-graphs
    python bench/graphs.py --parts c32,c32-no-graphs
    python bench/graphs.py --parts z-image-turbo,flux.1-schnell
    python bench/graphs.py --model /tmp/tiny-flux-dev --size 64 --steps 4 --runs 3 \\
        --parts c1,c1-no-graphs --flags "--device cpu --dtype fp32 --regional-compile on"
                                                             # the CPU smoke run

Random weights (`--load-format dummy`'s seeded recipe: the reference and the server compute
the same model), fp16 for SD1.5, bf16 for the transformers; SD1.5 at 512x512, 30 steps,
guidance 7.5 unless told. Parts:
- `reference`: plain diffusers, its UNet and VAE decoder compiled (`fullgraph`, channels-last,
  fused QKV as bench/models.py compiles them) with `max-autotune-no-cudagraphs`, one request at
  a time: `c1_reference_s` (median of `--runs`); `reference-ro`: the same with torch.compile's
  `reduce-overhead` (its own CUDA graphs): `c1_reference_reduce_overhead_s`.
- `c1`, `c1-no-graphs`: `vllm-omni-like serve sd15 --compile` (`--batch-buckets 1`, the size
  warmed up; `--cuda-graphs on`, or `off`), 50 requests one at a time after one warm-up:
  `c1_s` (`c1_no_graphs_s`) the median end to end, `c1_ratio` = c1_s / c1_reference_s,
  `c1_step_p90_over_p10` the spread of the steps on the device (the stage's timeline),
  `c1_e2e_p90_over_p10` of the requests, `graph_memory_gib` (/health: the graphs' pool).
- `c32`, `c32-no-graphs`: 32 closed-loop clients (`--max-batch-size 32`, `--batch-buckets 32`,
  `--batch-policy refill`), 8 images each after a warm-up round: `c32_img_s_graphs`,
  `c32_img_s_no_graphs`.
- `z-image-turbo`, `flux.1-schnell`: 1024x1024, batch 1, their published steps, with and without
  graphs: `<model>_s_graphs`, `<model>_s_no_graphs`, `<model>_graphs_ratio` (no regression:
  >= 0.99x means `no_graphs / graphs` >= 0.99).
Writes `bench/results/graphs-<device>.json` (`models.<model>`), a part's figures merged in as
it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from typing import Any

import httpx
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.cli_flags import add_dtype, add_model, add_outputs, parser
from bench.models import build, call_kwargs, denoiser, timed, write
from bench.raw_diffusers import DTYPES, PROMPT, free
from bench.server_proc import Server
from bench.serving import closed_loop
from bench.step_profile import read_timeline
from vllm_omni_like.stages.trace import TRACE_BATCHES_ENV, TRACE_DIR_ENV

# the transformers measured with and without graphs: steps, guidance (#59: 1024x1024, batch 1)
TRANSFORMERS = {"z-image-turbo": (8, 0.0), "flux.1-schnell": (4, 0.0)}


def spread(values: list[float]) -> float | None:
    """p90 / p10 of `values` (None for fewer than 10)."""
    if len(values) < 10:
        return None
    deciles = statistics.quantiles(values, n=10)
    return round(deciles[-1] / deciles[0], 4)


def reference(args: argparse.Namespace, mode: str) -> float:
    """Plain diffusers, compiled in `mode`, one request at a time: the median seconds."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pipe = build(args.model, DTYPES[args.dtype], device)
    s = {"steps": args.steps, "size": args.size, "call": call_kwargs(pipe, args.guidance)}
    model = denoiser(pipe)
    if hasattr(model, "fuse_qkv_projections"):
        model.fuse_qkv_projections()
    if model is getattr(pipe, "unet", None):
        model.to(memory_format=torch.channels_last)
        pipe.vae.to(memory_format=torch.channels_last)
    options = {"fullgraph": True, "dynamic": False, "mode": mode}
    name = "unet" if model is getattr(pipe, "unet", None) else "transformer"
    setattr(pipe, name, torch.compile(model, **options))
    pipe.vae.decoder = torch.compile(pipe.vae.decoder, **options)
    seconds = timed(pipe, s, args.runs)[0]
    del pipe
    free()
    return round(seconds, 4)


def serve_flags(args: argparse.Namespace, model: str, graphs: bool, batch: int) -> list[str]:
    on = "on" if torch.cuda.is_available() else "auto"  # (the CPU smoke: none to capture)
    flags = [model, "--load-format", "dummy", "--compile", "--cuda-graphs"]
    flags += [on if graphs else "off", "--batch-buckets", str(batch)]
    flags += ["--max-batch-size", str(batch), "--warmup-size", f"{args.size}x{args.size}"]
    flags += ["--max-queue-size", "4096", "--max-queue-seconds", "0", "--stall-timeout", "600"]
    if "--dtype" not in args.flags:
        flags += ["--dtype", args.dtype]
    return flags + shlex.split(args.flags)


def graph_bytes(url: str) -> int:
    stages = httpx.get(f"{url}/health", timeout=5).json()["stages"]
    return sum(r.get("cuda_graph_bytes", 0) for s in stages for r in s["replicas"])


def one_at_a_time(args: argparse.Namespace, model: str, graphs: bool) -> dict[str, Any]:
    """`--requests` requests one after the other (after one warm-up): their seconds end to
    end, each step's on the device, the graphs' memory."""
    timeline = tempfile.mkdtemp(prefix="graphs-timeline-")
    env = {**os.environ, TRACE_DIR_ENV: timeline, TRACE_BATCHES_ENV: ""}
    server = Server(serve_flags(args, model, graphs, 1), args.log, 1800, env=env)
    body = {"prompt": PROMPT, "size": f"{args.size}x{args.size}", "response_format": "b64_json"}
    body |= {"num_inference_steps": args.steps, "guidance_scale": args.guidance}
    times: list[float] = []
    try:
        memory = graph_bytes(server.url)
        with httpx.Client(base_url=server.url, timeout=600) as http:
            since = float("inf")
            for seed in range(args.requests + 1):
                t0 = time.perf_counter()
                http.post("/v1/images/generations", json={**body, "seed": seed}).raise_for_status()
                times.append(time.perf_counter() - t0)
                since = min(since, time.monotonic())  # (the timed requests' sets after it)
    finally:
        server.stop()
    steps = [
        at - before
        for line in read_timeline(timeline)
        if line["t0"] >= since
        for (_, before), (label, at) in itertools.pairwise(
            zip(line["labels"], line["ms"], strict=True)
        )
        if label == "step"
    ]
    return {"s": statistics.median(times[1:]), "e2e": times[1:], "steps": steps, "mem": memory}


def part_c1(args: argparse.Namespace, graphs: bool) -> dict[str, Any]:
    got = one_at_a_time(args, args.model, graphs)
    if not graphs:
        return {"c1_no_graphs_s": round(got["s"], 4)}
    return {
        "c1_s": round(got["s"], 4),
        "c1_step_p90_over_p10": spread(got["steps"]),
        "c1_e2e_p90_over_p10": spread(got["e2e"]),
        "c1_step_ms_median": round(statistics.median(got["steps"]), 3) if got["steps"] else None,
        "graph_memory_gib": round(got["mem"] / 2**30, 4),
    }


def part_c32(args: argparse.Namespace, graphs: bool) -> dict[str, Any]:
    flags = [*serve_flags(args, args.model, graphs, args.clients), "--batch-policy", "refill"]
    server = Server(flags, args.log, 1800)
    n = args.clients
    try:
        asyncio.run(closed_loop(server.url, args, n, n, 0))  # (a round: every bucket warm)
        _, seconds, _ = asyncio.run(closed_loop(server.url, args, n, n * 8, 0))
    finally:
        server.stop()
    return {f"c32_img_s_{'graphs' if graphs else 'no_graphs'}": round(n * 8 / seconds, 3)}


def part_transformer(args: argparse.Namespace, model: str) -> dict[str, Any]:
    steps, guidance = TRANSFORMERS[model]
    at = argparse.Namespace(**{**vars(args), "steps": steps, "guidance": guidance})
    at.size, at.requests, at.dtype = 1024, args.runs, "bf16"
    out = {}
    for graphs in (True, False):
        got = one_at_a_time(at, model, graphs)
        out[f"{model}_s_{'graphs' if graphs else 'no_graphs'}"] = round(got["s"], 4)
    out[f"{model}_graphs_ratio"] = round(out[f"{model}_s_no_graphs"] / out[f"{model}_s_graphs"], 4)
    return out


def run(part: str, args: argparse.Namespace) -> dict[str, Any]:
    if part == "reference":
        return {"c1_reference_s": reference(args, "max-autotune-no-cudagraphs")}
    if part == "reference-ro":
        return {"c1_reference_reduce_overhead_s": reference(args, "reduce-overhead")}
    if part in ("c1", "c1-no-graphs"):
        return part_c1(args, part == "c1")
    if part in ("c32", "c32-no-graphs"):
        return part_c32(args, part == "c32")
    return part_transformer(args, part)


def main() -> int:
    ap = parser(__doc__)
    add_model(ap, "sd15", "reference,c1")
    add_dtype(ap, DTYPES, "fp16")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--guidance", type=float, default=7.5)
    ap.add_argument("--runs", type=int, default=10, help="reference and transformer requests")
    ap.add_argument("--requests", type=int, default=50, help="c1's requests")
    ap.add_argument("--clients", type=int, default=32, help="c32's (a CPU smoke: fewer)")
    ap.add_argument("--flags", default="", help="more serve flags (quoted)")
    ap.add_argument("--output-format", default="png")
    add_outputs(ap, log="graphs.log")
    args = ap.parse_args()
    name = os.path.basename(os.path.normpath(args.model))
    for part in args.parts.split(","):
        entry = run(part, args)
        merged = write(name, entry, args.out_dir, prefix="graphs")
        if "c1_s" in merged and "c1_reference_s" in merged:
            merged = write(
                name,
                {"c1_ratio": round(merged["c1_s"] / merged["c1_reference_s"], 4)},
                args.out_dir,
                prefix="graphs",
            )
        print(json.dumps(merged), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
