"""R20: memory comes back after out-of-memory requests, and nothing creeps under load.

    python bench/memory.py gpu  [--before DIR] [--minutes 8]   # one GPU machine, one sitting
    python bench/memory.py cpu  [--minutes 20]                 # tiny-image on the CPU

gpu: `serve sd15` (random weights, fp16, eager, its limits raised on purpose so that a request
can really run out of memory), capped at --gpu-memory-fraction; with --before, an older
checkout's server beside it on the same GPU under the same cap, the two alternating c32 runs
(`c32_ratio_vs_before`). Then, on this tree's server:
  1. the device memory in use (torch.cuda.mem_get_info from this process: the worker's CUDA
     context, cuBLAS workspaces and allocator included, plus this process's own context, a
     constant) and the worker's reserved bytes (`/health`), after a warm-up;
  2. a burst of requests that run out of memory (n images at a large size) among normal ones:
     each must end 500 "out of memory", every other one 200;
  3. 10 s later the same readings: `oom_used_after_over_before`;
  4. --minutes of steady load (c16, 1% of requests out of memory), device memory and RSS (the
     server and its workers) sampled every 5 s: the fitted change over the last 6 minutes over
     its start, `creep_used_ratio` and `creep_rss_ratio`.
cpu: the same steady load on `tiny-image` (1% of requests with an injected out-of-memory
fault), RSS only. Results: bench/results/memory-<device>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

import httpx
import numpy as np
import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import contextlib

from bench.server_proc import Server

WINDOW_S = 360.0  # the creep is judged over the last 6 minutes
SAMPLE_S = 2.0
OOM_SHARE = 0.01


def sd15_args(fraction: float) -> list[str]:
    return [
        "sd15",
        "--load-format",
        "dummy",
        "--dtype",
        "fp16",
        "--max-batch-size",
        "32",
        "--max-queue-size",
        "4096",
        "--max-queue-seconds",
        "0",
        "--stall-timeout",
        "300",
        "--max-side",
        "4096",
        "--max-pixels",
        str(8 * 2048 * 2048),
        "--gpu-memory-fraction",
        str(fraction),
    ]


def body(i: int, oom: bool, cpu: bool) -> dict[str, Any]:
    if cpu:  # tiny-image: the fault rule selects '@oom' prompts
        prompt = "a red circle @oom" if oom else "a red circle"
        return {"model": "tiny-image", "prompt": prompt, "seed": i, "num_inference_steps": 4}
    if oom:  # 8 images of 2048x2048: they cannot fit under the cap (the VAE decode at least)
        return {"prompt": "x", "size": "2048x2048", "n": 8, "seed": i, "num_inference_steps": 1}
    return {"prompt": "a photo of a cat", "size": "512x512", "seed": i, "num_inference_steps": 20}


async def load(
    url: str, concurrency: int, total: int, cpu: bool, oom_share: float, stop_at: float = 0
) -> dict[str, Any]:
    """Closed loop: `concurrency` clients until `total` requests (or `stop_at` on the monotonic
    clock); every 1/oom_share-th request runs out of memory. Counts outcomes."""
    counts = {"ok": 0, "oom": 0, "oom_ok": 0, "failed": 0, "images": 0}
    errors: list[str] = []
    counter = iter(range(total))
    every = round(1 / oom_share) if oom_share else 0

    async def client(http: httpx.AsyncClient) -> None:
        for i in counter:
            if stop_at and time.monotonic() >= stop_at:
                return
            oom = bool(every) and i % every == every - 1
            r = await http.post("/v1/images/generations", json=body(i, oom, cpu))
            if oom:
                text = r.text
                if r.status_code == 500 and "out of memory" in text:
                    counts["oom"] += 1
                else:
                    counts["oom_ok"] += r.status_code == 200
                    errors.append(f"oom request {i}: {r.status_code} {text[:200]}")
            elif r.status_code == 200:
                counts["ok"] += 1
                counts["images"] += len(r.json()["data"])
            else:
                counts["failed"] += 1
                errors.append(f"request {i}: {r.status_code} {r.text[:200]}")

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        counts["seconds"] = time.perf_counter() - t0
    counts["errors"] = errors[:10]
    return counts


def c32(server: Server, requests: int) -> float:
    out = asyncio.run(load(server.url, 32, requests, cpu=False, oom_share=0))
    if out["failed"]:
        raise RuntimeError(f"c32 run failed: {out['errors']}")
    return out["images"] / out["seconds"]


def device_used() -> int:
    import torch

    free, total = torch.cuda.mem_get_info()
    return total - free


def reserved(server: Server) -> int:
    stages = httpx.get(f"{server.url}/health", timeout=10).json()["stages"]
    return sum(r["gpu_memory_bytes"] for s in stages for r in s["replicas"])


def tree_rss(pid: int) -> int:
    proc = psutil.Process(pid)
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += child.memory_info().rss
    return total


def creep(samples: list[tuple[float, float]]) -> float:
    """The fitted change over the last WINDOW_S over the fitted value at the window's start."""
    end = samples[-1][0]
    window = [(t, v) for t, v in samples if t >= end - WINDOW_S]
    t = np.array([s[0] for s in window])
    v = np.array([s[1] for s in window])
    slope, intercept = np.polyfit(t - t[0], v, 1)
    start = intercept
    return float(slope * (t[-1] - t[0]) / start)


def steady(server: Server, minutes: float, cpu: bool) -> dict[str, Any]:
    """Load for `minutes` while sampling RSS (and device memory on a GPU) every SAMPLE_S."""
    rss: list[tuple[float, float]] = []
    used: list[tuple[float, float]] = []
    stop_at = time.monotonic() + minutes * 60
    done = False

    async def sampler() -> None:
        t0 = time.monotonic()
        while not done:
            now = time.monotonic() - t0
            rss.append((now, float(tree_rss(server.proc.pid))))
            if not cpu:
                used.append((now, float(device_used())))
            await asyncio.sleep(SAMPLE_S)

    async def run() -> dict[str, Any]:
        nonlocal done
        task = asyncio.create_task(sampler())
        out = await load(server.url, 16 if not cpu else 4, 10**9, cpu, OOM_SHARE, stop_at)
        done = True
        await task
        return out

    out = asyncio.run(run())
    result = {
        "requests": out["ok"] + out["oom"] + out["failed"] + out["oom_ok"],
        "oom_requests": out["oom"],
        "peers_failed": out["failed"],
        "creep_rss_ratio": creep(rss),
        "rss_first_last_mib": [rss[0][1] / 2**20, rss[-1][1] / 2**20],
        "errors": out["errors"],
    }
    if used:
        result["creep_used_ratio"] = creep(used)
        # the allocator's cache saws between an OOM's emptying and its cap: the floor of each
        # 30 s is what the process really keeps
        result["creep_used_floor_ratio"] = creep(floors(used, 30.0))
        result["used_first_last_mib"] = [used[0][1] / 2**20, used[-1][1] / 2**20]
        result["used_series_mib"] = [[round(t, 1), round(v / 2**20)] for t, v in used]
    result["rss_series_mib"] = [[round(t, 1), round(v / 2**20)] for t, v in rss]
    return result


def floors(samples: list[tuple[float, float]], bin_s: float) -> list[tuple[float, float]]:
    """The lowest sample of each `bin_s` seconds, at the bin's middle."""
    bins: dict[int, float] = {}
    for t, v in samples:
        k = int(t // bin_s)
        bins[k] = min(v, bins.get(k, v))
    return [((k + 0.5) * bin_s, v) for k, v in sorted(bins.items())]


def oom_burst(server: Server) -> dict[str, Any]:
    """Four requests that run out of memory among 28 normal ones, all at once."""

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=900) as http:
            reqs = [body(i, oom=i % 8 == 3, cpu=False) for i in range(32)]
            return await asyncio.gather(
                *(http.post("/v1/images/generations", json=b) for b in reqs)
            )

    before_used, before_reserved = device_used(), reserved(server)
    responses = asyncio.run(run())
    oom = [r for i, r in enumerate(responses) if i % 8 == 3]
    peers = [r for i, r in enumerate(responses) if i % 8 != 3]
    time.sleep(10)
    after_used, after_reserved = device_used(), reserved(server)
    return {
        "oom_used_after_over_before": after_used / before_used,
        "oom_reserved_after_over_before": after_reserved / max(1, before_reserved),
        "used_before_after_mib": [before_used / 2**20, after_used / 2**20],
        "reserved_before_after_mib": [before_reserved / 2**20, after_reserved / 2**20],
        "oom_statuses": [r.status_code for r in oom],
        "oom_messages": [r.json()["error"]["message"][:160] for r in oom if r.status_code != 200],
        "peers_ok": sum(r.status_code == 200 for r in peers),
        "peers_failed": sum(r.status_code != 200 for r in peers),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=["gpu", "cpu"])
    ap.add_argument("--minutes", type=float, default=None)
    ap.add_argument("--before", help="an older checkout to compare c32 throughput with")
    ap.add_argument("--fraction", type=float, default=0.45)
    ap.add_argument("--c32-requests", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=4, help="c32 runs of each tree, alternated")
    ap.add_argument(
        "--parts",
        default="c32,oom,creep",
        help="gpu: which parts to run, in one sitting or split over calls (c32, oom, creep)",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--log", default="/tmp/memory-bench.log")
    args = ap.parse_args()
    cpu = args.mode == "cpu"
    minutes = args.minutes or (20.0 if cpu else 8.0)
    result: dict[str, Any] = {"mode": args.mode, "minutes": minutes}
    if cpu:
        os.environ["VLLM_OMNI_LIKE_FAULTS"] = "stage=diffusion,point=step,kind=oom,match=@oom"
        server = Server(["tiny-image", "--max-queue-size", "4096"], args.log, 300)
        try:
            result["device"] = "cpu"
            result.update(steady(server, minutes, cpu=True))
        finally:
            server.stop()
    else:
        import torch

        result["device"] = torch.cuda.get_device_name(0)
        server = Server(sd15_args(args.fraction), args.log, 600)
        parts = set(args.parts.split(","))
        before = before_server(args) if args.before and "c32" in parts else None
        try:
            c32(server, 64)  # warm-up (cuDNN, the allocator's pool)
            if "c32" in parts:
                result.update(compare_c32(server, before, args.c32_requests, args.rounds))
            if before is not None:
                before.stop()
                before = None
            if "oom" in parts:
                result.update(oom_burst(server))
                print(json.dumps(result, indent=1), flush=True)
            if "creep" in parts:
                result.update(steady(server, minutes, cpu=False))
        finally:
            server.stop()
            if before is not None:
                before.stop()
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def compare_c32(
    server: Server, before: Server | None, requests: int, rounds: int
) -> dict[str, Any]:
    """c32 throughput of this tree's server, and of the older one's, alternated."""
    if before is not None:
        c32(before, 64)  # its warm-up
    ours, theirs = [], []
    for _ in range(rounds):  # alternated: the GPU's clocks treat both alike
        ours.append(c32(server, requests))
        if before is not None:
            theirs.append(c32(before, requests))
    result: dict[str, Any] = {"c32_img_s": ours}
    if theirs:
        result["c32_img_s_before"] = theirs
        result["c32_ratio_vs_before"] = float(np.median(ours) / np.median(theirs))
    return result


def before_server(args: argparse.Namespace) -> Server:
    """The older checkout's server: the same command, run from its folder (`python -m` puts
    the working directory first on the path) with its package first on the path."""
    tree = os.path.abspath(args.before)
    env = dict(os.environ)
    env["PYTHONPATH"] = tree + os.pathsep + env.get("PYTHONPATH", "")
    return Server(sd15_args(args.fraction), args.log + ".before", 600, env=env, cwd=tree)


if __name__ == "__main__":
    sys.exit(main())
