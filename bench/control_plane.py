"""Control-plane cost on this CPU: null stages through HTTP + orchestrator + worker processes.

    python bench/control_plane.py --requests 3000 --concurrency 32

Starts `vllm-omni-like serve null-image` (one replica, steps=1, no delay) as its own process and
drives it over HTTP with closed-loop clients. Reports requests/s and the latency the serving path
adds per request (client latency minus the time the stage itself ran, which is ~0 for a null
stage), p50/p99. The 2-core VM is noisy (one run can differ from the next by 1.5x), so the
throughput figure is the median of `--repeats` timed runs, all listed.
Results: bench/results/control_plane-cpu.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import httpx
from server_proc import Server


async def drive(url: str, total: int, concurrency: int) -> tuple[list[float], float]:
    body = {"prompt": "x", "size": "8x8", "num_inference_steps": 1, "output_format": "png"}
    latencies: list[float] = []
    queue = list(range(total))

    async def client(http: httpx.AsyncClient) -> None:
        while queue:
            queue.pop()
            t0 = time.perf_counter()
            r = await http.post("/v1/images/generations", json=body)
            latencies.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        for _ in range(min(50, total)):  # warm up
            await http.post("/v1/images/generations", json=body)
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        return latencies, time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs; the median counts")
    ap.add_argument("--out", default="bench/results/control_plane-cpu.json")
    ap.add_argument("--server-flags", default="", help="more `serve` flags (write it with =)")
    args = ap.parse_args()
    flags = ["null-image", "--max-batch-size", "64", "--max-queue-size", "10000"]
    server = Server(flags + args.server_flags.split(), os.devnull, 60)
    try:
        url = server.url
        runs = [
            asyncio.run(drive(url, args.requests, args.concurrency)) for _ in range(args.repeats)
        ]
        serial, _ = asyncio.run(drive(url, 300, 1))  # one at a time: the added latency
    finally:
        server.stop()
    rates = [args.requests / wall for _, wall in runs]
    report = {
        "device": "cpu",
        "cores": os.cpu_count(),
        "requests": args.requests,
        "concurrency": args.concurrency,
        "server_flags": args.server_flags,
        "req_per_s": round(statistics.median(rates), 1),
        "req_per_s_runs": [round(r, 1) for r in rates],
        "latency_p50_ms_at_concurrency": round(pct(runs[0][0], 0.5) * 1000, 2),
        "added_latency_p50_ms": round(pct(serial, 0.5) * 1000, 2),
        "added_latency_p99_ms": round(pct(serial, 0.99) * 1000, 2),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
