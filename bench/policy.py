"""The batch policies on a GPU: closed-loop throughput and lone-request latency, same server.

    python bench/policy.py            # bench/results/policy-<gpu>.json

One server per setting (SD1.5 architecture as in bench/serving.py, eager, fp16, 512x512, 30
steps, CFG 7.5, batches up to 32): the default `refill` policy, and `request` with max waits of
0 and 0.2 s. Each is measured at concurrency 1 (p50 latency of a lone request: what a wait costs
an idle stage) and at concurrency 32 (img/s of closed-loop clients: whether batches stay whole).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

import raw_diffusers as ref
from cli_flags import add_outputs, parser
from control_plane import pct
from server_proc import Server
from serving import closed_loop, sd15_flags

SETTINGS = {
    "refill (default)": [],
    "request, max wait 0": ["--batch-policy", "request", "--batch-max-wait", "0"],
    "request, max wait 0.2 s": ["--batch-policy", "request", "--batch-max-wait", "0.2"],
}


def measure(args: argparse.Namespace, flags: list[str], log: str) -> dict[str, Any]:
    server = Server([*sd15_flags(args, 32), *flags], log, timeout=900)
    try:
        asyncio.run(closed_loop(server.url, args, 32, 32, 0))  # warm-up
        lat, _, _ = asyncio.run(closed_loop(server.url, args, 1, args.lone, 0))
        _, wall, _ = asyncio.run(closed_loop(server.url, args, 32, 32 * args.rounds, 0))
    finally:
        server.stop()
    return {
        "c1_latency_p50_s": round(pct(lat, 0.5), 3),
        "c32_img_s": round(32 * args.rounds / wall, 3),
    }


def main() -> None:
    ap = parser(__doc__)
    ref.add_workload_args(ap)
    ap.add_argument("--lone", type=int, default=6, help="requests at concurrency 1")
    ap.add_argument("--rounds", type=int, default=3, help="requests per client at c32")
    add_outputs(ap)
    args = ap.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    name = ref.device_name()
    report: dict[str, Any] = {"device": ref.gpu_name(), "settings": {}}
    for label, flags in SETTINGS.items():
        log = os.path.join(args.out_dir, f"policy-{name}.log")
        report["settings"][label] = measure(args, flags, log)
        print(label, report["settings"][label], file=sys.stderr)
        with open(os.path.join(args.out_dir, f"policy-{name}.json"), "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
