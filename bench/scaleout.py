"""Replicas over the GPUs of one host: throughput against one GPU, images, a compiled restart.

    python bench/scaleout.py --gpus 1,2,4          # on a machine with 4 GPUs

For each N of `--gpus`, `vllm-omni-like serve sd15 --load-format dummy --devices 0..N-1
--compile --batch-buckets 8,32` starts as its own process (one replica per GPU) and closed-loop
HTTP clients drive it at concurrency 32 x N (the SD1.5 architecture as in bench/serving.py:
512x512, 30 DDIM steps, CFG 7.5). Every N's images must equal N = 1's at the same seeds
(PSNR >= 35 dB). On the largest N, one replica's worker is SIGKILLed (its pid from /health) and
the time until /health shows that replica ready again is the compiled restart (the inductor
cache that the first start filled is shared under the server's cache dir).
Result: bench/results/scaleout-<device>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from typing import Any

import httpx
import numpy as np
import raw_diffusers as ref
from compare import PSNR_MIN_DB, db, psnr
from server_proc import Server
from serving import closed_loop

PER_GPU = 32  # closed-loop clients per replica


def restart_seconds(url: str, replica: int, timeout: float = 600.0) -> float:
    """SIGKILL the worker of `replica` (pipeline sd15's only stage); seconds until it is ready
    again with a new process."""
    stage = httpx.get(f"{url}/health", timeout=10).json()["stages"][0]
    pid = stage["replicas"][replica]["pids"][0]
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        r = httpx.get(f"{url}/health", timeout=10).json()["stages"][0]["replicas"][replica]
        if r["state"] == "ready" and r["pids"] and r["pids"][0] != pid:
            return time.monotonic() - t0
        time.sleep(0.05)
    raise RuntimeError(f"replica {replica} was not ready again within {timeout:.0f}s")


def run(args: argparse.Namespace, n: int, log: str) -> tuple[dict[str, Any], dict[int, Any]]:
    flags = [
        "sd15",
        "--load-format",
        "dummy",
        "--dtype",
        args.dtype,
        "--devices",
        ",".join(str(i) for i in range(n)),
        "--max-batch-size",
        str(PER_GPU),
        "--max-queue-size",
        "4096",
        "--max-queue-seconds",
        "0",
        "--stall-timeout",
        "600",
        "--warmup-size",
        f"{args.size}x{args.size}",
        "--compile",
        "--batch-buckets",
        args.batch_buckets,
    ]
    server = Server(flags, log, timeout=1800)
    out: dict[str, Any] = {"start_s": round(server.start_s, 1)}
    try:
        c = PER_GPU * n
        asyncio.run(closed_loop(server.url, args, c, c, 0))  # warm-up: every replica, full batch
        total = c * args.rounds
        _, wall, kept = asyncio.run(closed_loop(server.url, args, c, total, args.keep))
        out.update(concurrency=c, requests=total, img_s=round(total / wall, 3))
        health = httpx.get(f"{server.url}/health", timeout=10).json()["stages"][0]
        out["replicas"] = health["replicas"]
        print(f"N={n}: {out['img_s']} img/s at c{c}, start {out['start_s']} s", file=sys.stderr)
        if n == max(args.gpus) and n > 1 and args.restart:
            out["restart_s_compiled"] = round(restart_seconds(server.url, n - 1), 2)
            print(f"N={n}: compiled restart {out['restart_s_compiled']} s", file=sys.stderr)
    finally:
        server.stop()
    return out, kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", default="1,2,4", help="replica counts (GPUs 0..N-1 each)")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--guidance", type=float, default=7.5)
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--rounds", type=int, default=3, help="requests per client")
    ap.add_argument("--keep", type=int, default=8, help="seeds whose images are compared")
    ap.add_argument("--batch-buckets", default="8,32")
    ap.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out-dir", default="bench/results")
    args = ap.parse_args()
    args.gpus = [int(g) for g in args.gpus.split(",")]
    os.makedirs(args.out_dir, exist_ok=True)
    name = ref.device_name()
    path = os.path.join(args.out_dir, f"scaleout-{name}.json")
    log = os.path.join(args.out_dir, f"scaleout-{name}.log")
    report: dict[str, Any] = {
        "device": ref.gpu_name(),
        "gpus": max(args.gpus),
        "workload": f"sd15 dummy {args.size}x{args.size} {args.steps} steps CFG "
        f"{args.guidance} {args.dtype}, --compile --batch-buckets {args.batch_buckets}, "
        f"closed loop at {PER_GPU} clients per replica",
        "runs": {},
    }
    images: dict[int, dict[int, np.ndarray]] = {}
    for n in args.gpus:
        report["runs"][str(n)], images[n] = run(args, n, log)
        rates = {str(k): v["img_s"] for k, v in report["runs"].items()}
        report["replica_img_s"] = rates
        if "1" in rates:
            report["replica_speedup"] = {
                k: round(v / rates["1"], 3) for k, v in rates.items() if k != "1"
            }
        if 1 in images:
            worst = min(
                (psnr(images[1][s], img) for m in images if m != 1 for s, img in images[m].items()),
                default=float("inf"),
            )
            report["psnr_min_db"] = db(worst)
            report["images_equal"] = worst >= PSNR_MIN_DB
        restart = report["runs"][str(n)].get("restart_s_compiled")
        if restart is not None:
            report["restart_s_compiled"] = restart
        with open(path, "w") as f:  # saved run by run: a cut-off run keeps what it measured
            json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
