"""Replicas over the GPUs of one host: throughput against one GPU, images, a compiled restart.

    python bench/scaleout.py --gpus 1,2,4          # on a machine with 4 GPUs

For each N of `--gpus`, `vllm-omni-like serve sd15 --load-format dummy --devices 0..N-1
--compile --batch-buckets 8,32 --batch-policy refill` starts as its own process (one replica
per GPU) and closed-loop HTTP clients drive it at concurrency `--per-gpu` (32) x N (the SD1.5
architecture as in bench/serving.py: 512x512, 30 DDIM steps, CFG 7.5); each N's batch use
(batches, mean size, split batches) is read from /metrics. `--server-flags ''` measures the
server's default (step-level batching) instead; `--single-also` adds a one-GPU run with other
flags (the best one-GPU figure of the two is what N GPUs are measured against). Every N's
images must equal N = 1's at the same seeds (PSNR >= 35 dB). On the largest N, one replica's
worker is SIGKILLed (its pid from /health) and the time until /health shows that replica ready
again is the compiled restart (the inductor cache that the first start filled is shared under
the server's cache dir).
Result: bench/results/scaleout-<device><label>.json.
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
from cli_flags import add_outputs, parser
from compare import PSNR_MIN_DB, db, psnr
from server_proc import Server
from serving import closed_loop, image_body, sd15_flags

MAX_BATCH = 32  # the replicas' --max-batch-size (and the default clients per replica)


def wait_ready(url: str, replica: int, old_pid: int | None, timeout: float = 600.0) -> int:
    """Wait until `replica` is ready with a worker other than `old_pid`; its pid."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        r = httpx.get(f"{url}/health", timeout=10).json()["stages"][0]["replicas"][replica]
        if r["state"] == "ready" and r["pids"] and r["pids"][0] != old_pid:
            return r["pids"][0]
        time.sleep(0.05)
    raise RuntimeError(f"replica {replica} was not ready again within {timeout:.0f}s")


def restart_seconds(url: str, replica: int) -> float:
    """SIGKILL the worker of `replica` (pipeline sd15's only stage); seconds until it is ready
    again with a new process."""
    pid = wait_ready(url, replica, None)  # (a kill before may still be restarting it)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    wait_ready(url, replica, pid)
    return time.monotonic() - t0


def batch_counts(url: str) -> dict[str, float]:
    """The diffusion stage's batch-size histogram from /metrics: batches, requests in them, and
    batches of at most half the largest size (a closed loop's batches split by the policy)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {"batches": 0.0, "requests": 0.0, "split": 0.0}
    for line in text.splitlines():
        if not line.startswith("vllm_omni_like_batch_size") or 'stage="diffusion"' not in line:
            continue
        value = float(line.rsplit(" ", 1)[1])
        if line.startswith("vllm_omni_like_batch_size_count"):
            out["batches"] = value
        elif line.startswith("vllm_omni_like_batch_size_sum"):
            out["requests"] = value
        elif f'le="{MAX_BATCH // 2}.0"' in line:
            out["split"] = value
    return out


def batch_use(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    batches = after["batches"] - before["batches"]
    requests = after["requests"] - before["requests"]
    return {
        "batches": int(batches),
        "mean_batch": round(requests / max(batches, 1), 2),
        f"batches_up_to_{MAX_BATCH // 2}": int(after["split"] - before["split"]),
    }


def worker_pid(url: str, replica: int) -> int:
    stage = httpx.get(f"{url}/health", timeout=10).json()["stages"][0]
    return stage["replicas"][replica]["pids"][0]


async def kill_under_load(
    url: str, args: argparse.Namespace, clients: int, total: int, victim: int
):
    """Closed-loop clients; once a third of the requests came back, SIGKILL replica `victim`'s
    worker. Every request must succeed; returns the completion times and the kill's time."""
    done: list[float] = []
    counter = iter(range(total))
    killed: list[float] = []

    async def client(http: httpx.AsyncClient) -> None:
        for seed in counter:
            r = await http.post("/v1/images/generations", json=image_body(args, seed))
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
            done.append(time.perf_counter())

    async def chaos() -> None:
        while len(done) < total // 3:
            await asyncio.sleep(0.01)
        os.kill(await asyncio.to_thread(worker_pid, url, victim), signal.SIGKILL)
        killed.append(time.perf_counter())

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)), chaos())
    return done, killed[0]


def run(
    args: argparse.Namespace, n: int, log: str, extra: str = ""
) -> tuple[dict[str, Any], dict[int, Any]]:
    flags = [
        *sd15_flags(args, MAX_BATCH),
        "--devices",
        ",".join(str(i) for i in range(n)),
        "--compile",
        "--batch-buckets",
        args.batch_buckets,
    ]
    server = Server([*flags, *args.server_flags.split(), *extra.split()], log, timeout=1800)
    out: dict[str, Any] = {"start_s": round(server.start_s, 1)}
    try:
        c = args.per_gpu * n
        asyncio.run(closed_loop(server.url, args, c, c, 0))  # warm-up: every replica, full batch
        total = c * args.rounds
        before = batch_counts(server.url)
        cpu = server.cpu_seconds()
        _, wall, kept = asyncio.run(closed_loop(server.url, args, c, total, args.keep))
        out.update(concurrency=c, requests=total, img_s=round(total / wall, 3))
        out["host_cpu_ms_per_image"] = server.cpu_ms_per_image(cpu, total)
        out["batch_use"] = batch_use(before, batch_counts(server.url))
        health = httpx.get(f"{server.url}/health", timeout=10).json()["stages"][0]
        out["replicas"] = health["replicas"]
        print(
            f"N={n}: {out['img_s']} img/s at c{c}, start {out['start_s']} s, batches "
            f"{out['batch_use']}",
            file=sys.stderr,
        )
        if n == max(args.gpus) and n > 1 and args.kill_under_load:
            batch_s = MAX_BATCH / (out["img_s"] / n)  # one replica's full batch
            done, at = asyncio.run(kill_under_load(server.url, args, c, c * args.rounds, n - 1))
            after = [t for t in done if t >= at]
            gaps = [b - a for a, b in zip([at, *after], after, strict=False)]
            out["kill_under_load"] = {
                "requests": len(done),
                "all_succeeded": len(done) == c * args.rounds,
                "replica_batch_s": round(batch_s, 2),
                "max_gap_after_kill_s": round(max(gaps), 2),
                "max_gap_over_batch": round(max(gaps) / batch_s, 2),
            }
            print(f"N={n}: kill under load {out['kill_under_load']}", file=sys.stderr)
        if n == max(args.gpus) and n > 1 and args.restart:
            out["restart_s_compiled"] = round(restart_seconds(server.url, n - 1), 2)
            print(f"N={n}: compiled restart {out['restart_s_compiled']} s", file=sys.stderr)
    finally:
        server.stop()
    return out, kept


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--gpus", default="1,2,4", help="replica counts (GPUs 0..N-1 each)")
    ref.add_workload_args(ap)
    ap.add_argument("--rounds", type=int, default=5, help="requests per client")
    ap.add_argument(
        "--per-gpu",
        type=int,
        default=MAX_BATCH,
        help="closed-loop clients per replica (64 keeps a step-level set of 32 full while "
        "answered clients are on their way back)",
    )
    ap.add_argument("--keep", type=int, default=8, help="seeds whose images are compared")
    ap.add_argument("--batch-buckets", default="8,32")
    ap.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--kill-under-load", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument(
        "--server-flags",
        default="--batch-policy refill",
        help="more `serve` flags (default: the policy for closed-loop clients; '' for the "
        "server's default)",
    )
    ap.add_argument(
        "--single-also",
        default="",
        help="more `serve` flags for a second one-GPU run (e.g. '--batch-level request'): "
        "per_gpu_at_<N>_over_best_single takes the better of the two",
    )
    ap.add_argument("--label", default="", help="suffix of the result files' names")
    add_outputs(ap)
    args = ap.parse_args()
    args.gpus = [int(g) for g in args.gpus.split(",")]
    os.makedirs(args.out_dir, exist_ok=True)
    name = ref.device_name()
    path = os.path.join(args.out_dir, f"scaleout-{name}{args.label}.json")
    log = os.path.join(args.out_dir, f"scaleout-{name}{args.label}.log")
    report: dict[str, Any] = {
        "device": ref.gpu_name(),
        "gpus": max(args.gpus),
        "workload": f"sd15 dummy {args.size}x{args.size} {args.steps} steps CFG "
        f"{args.guidance} {args.dtype}, --compile --batch-buckets {args.batch_buckets}, "
        f"closed loop at {args.per_gpu} clients per replica, {args.rounds} requests each"
        + (f", serve flags {args.server_flags}" if args.server_flags else ""),
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
        if n == 1 and args.single_also:  # the other batching mode on one GPU
            report["runs"]["1-also"], _ = run(args, 1, log, args.single_also)
            report["single_also_flags"] = args.single_also
        save(report, path)
    per_gpu_over_best_single(report, max(args.gpus))
    save(report, path)
    print(json.dumps(report, indent=2))


def save(report: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:  # saved run by run: a cut-off run keeps what it measured
        json.dump(report, f, indent=2)


def per_gpu_over_best_single(report: dict[str, Any], n: int) -> None:
    """`per_gpu_at_<n>_over_best_single`: img/s per GPU at N = n over the best one-GPU figure
    (the server's flags, or `--single-also`'s)."""
    runs = report["runs"]
    singles = [runs[k]["img_s"] for k in ("1", "1-also") if k in runs]
    if n > 1 and str(n) in runs and singles:
        per_gpu = runs[str(n)]["img_s"] / n
        report[f"per_gpu_at_{n}_over_best_single"] = round(per_gpu / max(singles), 4)


if __name__ == "__main__":
    main()
