"""Step-level batching against request-level batching, on one GPU in one sitting (#36).

    python bench/step_level.py --parts warm --modes step   # cold: fill the inductor cache
    python bench/step_level.py --parts c64,ceiling      # one GPU sitting (one call)
    python bench/step_level.py --parts mixed            # the next (or mixed-max, mixed-trace)
    python bench/step_level.py --tiny --parts c64,mixed # a CPU smoke run of the bench itself

Two servers on the same GPU (`--gpu-memory-fraction 0.45` each): the SD1.5 architecture with
random weights, fp16, `--compile` (buckets 1,8,16,32; warm-up sizes 512x512 and 768x768),
`--max-batch-size 32`; one `--batch-level step`, one `--batch-level request`, all else equal.
Both start once (at the same time: they compile side by side) and their runs alternate.
`--gpus 0,1` gives each mode a GPU of its own instead (the whole GPU each; the same load runs
through both at the same time).
- c64: 64 closed-loop clients, 512x512, 30 steps, CFG 7.5: img/s each round (the first round
  after start-up reported apart: `c64_first_round_img_s`).
- ceiling: after the servers stop, this process runs the SD1.5 UNet compiled the same way at
  32 images (64 CFG rows) for 30 steps and the VAE decoder at 32 (per-step device time, CUDA
  events): 32 / (30 x step + decode) img/s, no server.
- mixed: requests drawn from one seeded mix (steps 10-50, guidance 7.5 or 1 (off), 512x512 or
  768x768): each mode's maximum sustainable throughput (closed loop, 64 clients, img/s); then
  one seeded Poisson arrival trace at 80 % of the request-level maximum (>= 500 requests)
  through each mode: p50 / p99 latency.
- recompiles: each server's `vllm_omni_like_compiles_total` after its warm-up, against at the
  end of its runs.
- images: the same 4 requests of the mix from both servers, PSNR (>= 35 dB: equal).
- `--timeline DIR`: the step-level server's step timeline (stages/trace.py): each step's
  device time by the requests it ran, and the images a second its steps made on the device.
Results: `bench/results/step_level-<device>.json` (everything) and the issue's keys merged into
`bench/results/serving-<device>.json`: `server_c64_img_s`, `gpu_ceiling_img_s`,
`mixed_p99_ratio`, `mixed_max_throughput_ratio`, `recompiles`.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import concurrent.futures
import io
import json
import os
import random
import re
import statistics
import sys
import time
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.cli_flags import add_outputs, parser
from bench.compare import psnr
from bench.control_plane import pct
from bench.memory import sd15_args
from bench.server_proc import Server
from bench.step_profile import part_ceiling, step_timeline
from vllm_omni_like.stages.trace import TRACE_DIR_ENV as TRACE_DIR

FRACTION = 0.45  # two servers on one GPU
FRACTION_OWN_GPU = 0.9
COMPILED = ["--compile", "--batch-buckets", "1,8,16,32"]
WARMUP_SIZES = "512x512,768x768"
TINY = ["tiny-image", "--max-batch-size", "32", "--max-queue-size", "4096"]
MODES = ("step", "request")


def mix(i: int, tiny: bool) -> dict[str, Any]:
    """Request `i` of the seeded mix."""
    rng = random.Random(i)
    side = rng.choice((48, 64)) if tiny else rng.choice((512, 768))
    steps = rng.randint(2, 8) if tiny else rng.randint(10, 50)
    return {
        "prompt": "a photo of a cat",
        "size": f"{side}x{side}",
        "num_inference_steps": steps,
        "guidance_scale": rng.choice((7.5, 1.0)),
        "seed": i,
        "response_format": "b64_json",
    }


def c64_body(i: int, tiny: bool) -> dict[str, Any]:
    side, steps = (64, 4) if tiny else (512, 30)
    body = {"prompt": "a photo of a cat", "size": f"{side}x{side}", "seed": i}
    return {**body, "num_inference_steps": steps, "guidance_scale": 7.5}


async def closed_loop(url: str, clients: int, bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """`clients` clients through `bodies`, each sending its next as its last ends."""
    todo = iter(bodies)
    latencies: list[float] = []
    failed: list[str] = []

    async def client(http: httpx.AsyncClient) -> None:
        for body in todo:
            t0 = time.perf_counter()
            r = await http.post("/v1/images/generations", json=body)
            if r.status_code != 200:
                failed.append(f"{r.status_code} {r.text[:200]}")
            latencies.append(time.perf_counter() - t0)

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        seconds = time.perf_counter() - t0
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[:3]}")
    return {"img_s": round(len(bodies) / seconds, 3), "seconds": round(seconds, 2)}


async def open_loop(url: str, bodies: list[dict[str, Any]], rate: float, seed: int) -> list[float]:
    """`bodies` sent at the arrival times of a seeded Poisson process of `rate` a second; each
    request's latency."""
    rng = random.Random(seed)
    at, arrivals = 0.0, []
    for _ in bodies:
        at += rng.expovariate(rate)
        arrivals.append(at)
    latencies: list[float] = [0.0] * len(bodies)
    failed: list[str] = []

    async def one(http: httpx.AsyncClient, i: int, start: float) -> None:
        await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        t0 = time.perf_counter()
        r = await http.post("/v1/images/generations", json=bodies[i])
        if r.status_code != 200:
            failed.append(f"{r.status_code} {r.text[:200]}")
        latencies[i] = time.perf_counter() - t0

    limits = httpx.Limits(max_connections=len(bodies) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=1800, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(one(http, i, start) for i in range(len(bodies))))
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[:3]}")
    return latencies


def compiles(server: Server) -> int:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    found = re.search(r"^vllm_omni_like_compiles_total (\S+)$", text, re.M)
    return int(float(found.group(1))) if found else 0


def pixels(r: httpx.Response) -> np.ndarray:
    from PIL import Image

    png = base64.b64decode(r.json()["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def start(args: argparse.Namespace, modes: list[str]) -> dict[str, Server]:
    """The servers of `modes`, started side by side (on `--gpus`, one each, when given); the
    step-level one writes its step timeline to `--timeline` (a directory; "" for none)."""
    fraction = FRACTION_OWN_GPU if args.gpus else FRACTION
    base = TINY if args.tiny else [*sd15_args(fraction), *COMPILED]
    for size in [] if args.tiny else args.warmup_sizes.split(","):
        base += ["--warmup-size", size]
    env = dict(os.environ)
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/inductor-cache")  # a later sitting reuses it
    envs = {mode: dict(env) for mode in modes}
    for mode, gpu in zip(modes, args.gpus.split(",") if args.gpus else [], strict=False):
        envs[mode]["CUDA_VISIBLE_DEVICES"] = gpu
    if args.timeline and "step" in envs:
        envs["step"] |= {TRACE_DIR: args.timeline, "VLLM_OMNI_LIKE_TRACE_BATCHES": ""}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {
            mode: pool.submit(
                Server, [*base, "--batch-level", mode], f"{args.log}.{mode}", 1500, envs[mode]
            )
            for mode in modes
        }
        return {mode: f.result() for mode, f in futures.items()}


def each_mode(servers: dict[str, Server], args: argparse.Namespace, run: Any) -> dict[str, Any]:
    """`run(mode, url)` for every server: at the same time when each has a GPU of its own
    (`--gpus`), else one after the other (they share the GPU)."""
    if not args.gpus:
        return {mode: run(mode, server.url) for mode, server in servers.items()}
    with concurrent.futures.ThreadPoolExecutor(len(servers)) as pool:
        futures = {mode: pool.submit(run, mode, s.url) for mode, s in servers.items()}
        return {mode: f.result() for mode, f in futures.items()}


def part_c64(servers: dict[str, Server], args: argparse.Namespace) -> dict[str, Any]:
    bodies = [c64_body(i, args.tiny) for i in range(args.c64_requests)]
    rounds: dict[str, list[float]] = {m: [] for m in servers}

    def one(mode: str, url: str) -> float:
        out = asyncio.run(closed_loop(url, 64, bodies))
        print(f"c64 {mode}: {out}, compiles so far {compiles(servers[mode])}", flush=True)
        return out["img_s"]

    # the first traffic after start-up: both modes' first rounds ran seconds slow (requests
    # reached the worker seconds apart, in both modes); kept apart from the steady rounds
    first = each_mode(servers, args, one) if args.first_round else {}
    for _ in range(args.rounds):
        for mode, img_s in each_mode(servers, args, one).items():
            rounds[mode].append(img_s)
    med = {m: statistics.median(v) for m, v in rounds.items()}
    result: dict[str, Any] = {"c64_img_s": rounds, "c64_first_round_img_s": first}
    if "step" in med:
        result["server_c64_img_s"] = med["step"]
    if "request" in med:
        result["request_level_c64_img_s"] = med["request"]
    if len(med) == len(MODES):
        result["c64_step_over_request"] = round(med["step"] / med["request"], 4)
    return result


def part_mixed_max(servers: dict[str, Server], args: argparse.Namespace) -> dict[str, Any]:
    """Each mode's maximum sustainable throughput on the mix (closed loop, 64 clients)."""
    closed = [mix(i, args.tiny) for i in range(args.mixed_closed)]

    def one(mode: str, url: str) -> float:
        img_s = asyncio.run(closed_loop(url, 64, closed))["img_s"]
        print(f"mixed max {mode}: {img_s} img/s", flush=True)
        return img_s

    best = each_mode(servers, args, one)
    result: dict[str, Any] = {"mixed_max_img_s": best}
    if len(best) == len(MODES):
        result["mixed_max_throughput_ratio"] = round(best["step"] / best["request"], 4)
    if "request" in best and not args.rate:
        args.rate = 0.8 * best["request"]  # the trace's offered load
    return result


def part_mixed_trace(servers: dict[str, Server], args: argparse.Namespace) -> dict[str, Any]:
    """One seeded Poisson trace at `--rate` (80 % of request-level's maximum) through each
    mode: p50 / p99 latency."""
    if not args.rate:
        raise SystemExit("mixed-trace needs --rate (or mixed-max with the request server first)")
    trace = [mix(100_000 + i, args.tiny) for i in range(args.mixed_requests)]
    result: dict[str, Any] = {"offered_req_s": round(args.rate, 3)}

    def one(mode: str, url: str) -> dict[str, Any]:
        lat = asyncio.run(open_loop(url, trace, args.rate, seed=7))
        out = {
            "p50_s": round(pct(lat, 0.5), 3),
            "p99_s": round(pct(lat, 0.99), 3),
            "mean_s": round(statistics.fmean(lat), 3),
            "requests": len(lat),
            **tail_of(trace, lat),
        }
        print(f"mixed trace {mode}: {out}", flush=True)
        return out

    for mode, out in each_mode(servers, args, one).items():
        result[f"mixed_{mode}"] = out
    if len(servers) == len(MODES):
        p99 = {m: result[f"mixed_{m}"]["p99_s"] for m in MODES}
        result["mixed_p99_ratio"] = round(p99["step"] / p99["request"], 4)
    return result


def tail_of(trace: list[dict[str, Any]], lat: list[float]) -> dict[str, Any]:
    """Who makes the tail: p50 / p99 of each kind of request of the mix (size, guided or not),
    and the five slowest requests (their place in the trace, size, steps, guidance, seconds)."""
    kinds: dict[str, list[float]] = {}
    for body, seconds in zip(trace, lat, strict=True):
        guided = "cfg" if body["guidance_scale"] > 1 else "no-cfg"
        kinds.setdefault(f"{body['size']} {guided}", []).append(seconds)
    slowest = sorted(range(len(lat)), key=lambda i: -lat[i])[:5]
    return {
        "by_kind": {
            k: {"p50_s": round(pct(v, 0.5), 3), "p99_s": round(pct(v, 0.99), 3), "n": len(v)}
            for k, v in sorted(kinds.items())
        },
        "slowest": [
            [
                i,
                trace[i]["size"],
                trace[i]["num_inference_steps"],
                trace[i]["guidance_scale"],
                round(lat[i], 3),
            ]
            for i in slowest
        ],
    }


PARTS = {"c64": [part_c64], "mixed": [part_mixed_max, part_mixed_trace]}
PARTS |= {"mixed-max": [part_mixed_max], "mixed-trace": [part_mixed_trace], "warm": []}


def images_equal(servers: dict[str, Server], tiny: bool) -> dict[str, Any]:
    got: dict[str, list[np.ndarray]] = {m: [] for m in MODES}
    for i in range(4):
        for mode in MODES:
            r = httpx.post(
                f"{servers[mode].url}/v1/images/generations", json=mix(900 + i, tiny), timeout=600
            )
            r.raise_for_status()
            got[mode].append(pixels(r))
    values = [psnr(a, b) for a, b in zip(got["step"], got["request"], strict=True)]
    return {"psnr_db": [round(v, 2) if np.isfinite(v) else "inf" for v in values]}


def device() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--parts", default="c64,ceiling")
    ap.add_argument("--tiny", action="store_true", help="tiny-image on the CPU (a smoke run)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--c64-requests", type=int, default=128)
    ap.add_argument(
        "--first-round",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="c64: a first round after start-up, reported apart from the --rounds",
    )
    ap.add_argument("--mixed-closed", type=int, default=128)
    ap.add_argument("--mixed-requests", type=int, default=500)
    ap.add_argument("--ceiling-steps", type=int, default=10)
    ap.add_argument("--timeline", default="", help="the step server's timeline directory")
    ap.add_argument("--modes", default="step,request", help="the servers to start")
    ap.add_argument("--rate", type=float, default=0.0, help="mixed-trace's offered req/s")
    ap.add_argument("--gpus", default="", help="a GPU per mode (e.g. 0,1), in --modes' order")
    ap.add_argument("--warmup-sizes", default=WARMUP_SIZES, help="the servers' --warmup-size")
    add_outputs(ap, log="step_level.log")
    args = ap.parse_args()
    parts = args.parts.split(",")
    result: dict[str, Any] = {"device": device(), "parts": parts}
    served = [p for p in parts if p in PARTS]
    if served:
        result.update(serve(served, args))
    if args.timeline and served:  # (the sets drained as the servers stopped: all written)
        steps = 4 if args.tiny else 30
        result["step_timeline"] = step_timeline(args.timeline, steps, result["served_at"])
    if "ceiling" in parts and not args.tiny:
        result.update(part_ceiling(args))
    print(json.dumps(result), flush=True)
    write(result, args.out_dir)
    return 0


def serve(parts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    """Start the servers once, run `parts` through them, count their recompiles."""
    servers = start(args, args.modes.split(","))
    result: dict[str, Any] = {}
    try:
        result["start_s"] = {m: round(s.start_s, 1) for m, s in servers.items()}
        warm = {m: compiles(s) for m, s in servers.items()}
        print(f"started {result['start_s']} s, compiles {warm}", flush=True)
        result["served_at"] = time.monotonic()  # (the timeline's sets after this: the runs')
        for part in parts:
            for run in PARTS[part]:
                result.update(run(servers, args))
        if len(servers) == len(MODES) and parts != ["warm"]:
            result["images"] = images_equal(servers, args.tiny)
        end = {m: compiles(s) for m, s in servers.items()}
        result["compiles_after_warm_up"] = warm
        if parts != ["warm"]:
            result["recompiles"] = sum(end[m] - warm[m] for m in servers)
    finally:
        for server in servers.values():
            server.stop()
    return result


def write(result: dict[str, Any], out_dir: str) -> None:
    from bench.raw_diffusers import device_name

    os.makedirs(out_dir, exist_ok=True)
    name = device_name()
    with open(os.path.join(out_dir, f"step_level-{name}.jsonl"), "a") as f:
        f.write(json.dumps(result) + "\n")
    keys = ("server_c64_img_s", "gpu_ceiling_img_s", "mixed_p99_ratio")
    keys += ("mixed_max_throughput_ratio", "recompiles")
    path = os.path.join(out_dir, f"serving-{name}.json")
    merged: dict[str, Any] = {}
    if os.path.exists(path):
        with open(path) as f:
            merged = json.load(f)
    merged.update({k: result[k] for k in keys if k in result})
    with open(path, "w") as f:
        json.dump(merged, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
