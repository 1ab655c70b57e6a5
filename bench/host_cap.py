"""The host side's ceiling: how many images a second the API process answers when the stage
does no work at all.

    python bench/host_cap.py --replicas 4 --clients 128 --label '4x H200 host'

Each run is appended to bench/results/host_cap.jsonl.

`vllm-omni-like serve null-image --replicas N` (null stages: one step, no delay, 512x512 noise
images, the hardest case for PNG's deflate) driven by closed-loop HTTP clients asking for b64
JSON as bench/serving.py does. Reports img/s and the CPU each image costs the API process
(HTTP, orchestrator, PNG encode, JSON), the workers and this client; `--output-format jpeg`
shows what the PNG encode itself costs. A GPU run whose img/s sits near this figure is bound by
the host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cli_flags import add_outputs, parser
from server_proc import Server
from serving import closed_loop


def measure(args: argparse.Namespace) -> dict[str, Any]:
    flags = ["null-image", "--max-batch-size", "32", "--max-queue-size", "8192"]
    server = Server([*flags, "--replicas", str(args.replicas)], args.log, 120)
    try:
        asyncio.run(closed_loop(server.url, args, args.clients, args.clients, 0))  # warm-up
        before = server.cpu_seconds()
        _, wall, _ = asyncio.run(closed_loop(server.url, args, args.clients, args.requests, 0))
        cost = server.cpu_ms_per_image(before, args.requests)
    finally:
        server.stop()
    return {
        "replicas": args.replicas,
        "clients": args.clients,
        "format": args.output_format,
        "img_s": round(args.requests / wall, 2),
        "cpu_ms_per_image": cost,
        "api_cores": round(cost["api"] * args.requests / 1000 / wall, 2),
    }


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--clients", type=int, default=128)
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--output-format", default="png", choices=("png", "jpeg", "webp"))
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--label", default="", help="the machine, in words (kept with the run)")
    add_outputs(ap, log=os.devnull)
    args = ap.parse_args()
    args.steps, args.guidance = 1, 7.5  # (what serving.image_body reads)
    result = {"machine": args.label or platform.node(), "cpus": os.cpu_count(), **measure(args)}
    print(json.dumps(result), flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "host_cap.jsonl"), "a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
