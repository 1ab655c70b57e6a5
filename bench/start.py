"""A compiled server's start and a replica's restart, with and without the compile cache (#59).

    python bench/start.py --model sd15                      # every part, one GPU call a model
    python bench/start.py --model flux.1-dev --parts warm,restart   # the cache kept from `cold`
    python bench/start.py --model /tmp/tiny-flux-dev --flags "--device cpu --dtype fp32 \\
        --regional-compile on --batch-buckets 1 --max-batch-size 1"   # the CPU smoke run

`vllm-omni-like serve <model> --load-format dummy --compile` at the default flags (SD1.5: its
default buckets, 8 compiled shapes; FLUX.1-dev, Wan2.2-TI2V-5B: theirs) with `--compile-cache`
in `--cache-dir/<model>`, each part a server process of its own:
- `cold`: the cache emptied first; the seconds from the process's start to /health 200
  (`cold_start_s`), and what its replica's worker said (`cold_worker_s`: load, compile,
  warm-up; its cache misses).
- `warm`: the same over the cache `cold` left (`warm_start_s`, `warm_worker_s`, hits, misses,
  `warm_precompiled`: forwards loaded precompiled, `warm_traced`: graphs dynamo traced).
- `restart`: a warm server; its replica's worker SIGKILLed, then the seconds until /health says
  the replica is ready again (`restart_to_ready_s`, polled every 50 ms) and what the engine
  measured (`restart_seconds` in /health, `vllm_omni_like_replica_restart_seconds`).
Writes `bench/results/start-<device>.json`: `models.<name>` with `cold_start_s`,
`warm_start_s`, `restart_to_ready_s` and the figures beside them; a part's are merged in as it
ends. The goals on one H100 (#59): restart to ready <= 15 s, a warm start <= 45 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import sys
import time
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.cli_flags import add_model, add_outputs, parser
from bench.models import write
from bench.server_proc import Server


def replica(url: str) -> dict[str, Any]:
    """The first diffusion stage's first replica, as /health shows it."""
    stages = httpx.get(f"{url}/health", timeout=5).json()["stages"]
    stage = next(s for s in stages if s.get("family")) if len(stages) > 1 else stages[0]
    return stage["replicas"][0]


def started(server: Server, label: str) -> dict[str, Any]:
    """What a start took: the process's to /health 200, and its replica's worker's report."""
    r = replica(server.url)
    cache = r.get("compile_cache", {})
    return {
        f"{label}_start_s": round(server.start_s, 2),
        f"{label}_worker_s": r.get("start_seconds"),
        f"{label}_cache_hits": cache.get("hits"),
        f"{label}_cache_misses": cache.get("misses"),
        f"{label}_precompiled": cache.get("precompiled"),  # forwards loaded without a trace
        f"{label}_traced": cache.get("traced"),  # graphs dynamo traced (0: none)
        f"{label}_cuda_graphs": len(r.get("cuda_graphs", [])),
    }


def restart(server: Server, timeout: float) -> dict[str, Any]:
    """Kill the replica's worker; the seconds until /health has it ready again."""
    pid = replica(server.url)["pids"][0]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    while time.monotonic() - t0 < timeout:
        try:
            r = replica(server.url)
        except (httpx.TransportError, ValueError):
            r = {}
        if r.get("state") == "ready" and r.get("pids", [pid])[0] != pid:
            took = time.monotonic() - t0
            cache = r.get("compile_cache", {})
            return {
                "restart_to_ready_s": round(took, 2),
                "restart_seconds": r.get("restart_seconds"),  # the engine's: death to ready
                "restart_worker_s": r.get("start_seconds"),
                "restart_cache_hits": cache.get("hits"),
                "restart_cache_misses": cache.get("misses"),
                "restart_precompiled": cache.get("precompiled"),
                "restart_traced": cache.get("traced"),
            }
        time.sleep(0.05)
    raise RuntimeError(f"the replica was not ready {timeout:.0f} s after its worker's death")


def run_part(part: str, args: argparse.Namespace, cache: str) -> dict[str, Any]:
    if part == "cold":
        shutil.rmtree(cache, ignore_errors=True)
    flags = [args.model, "--load-format", "dummy", "--compile", "--compile-cache", cache]
    flags += ["--max-restarts", "3", *shlex.split(args.flags)]
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    server = Server(flags, args.log, args.timeout, env=env)
    try:
        if part == "restart":
            return restart(server, args.timeout)
        return started(server, part)
    finally:
        server.stop()


def main() -> int:
    ap = parser(__doc__)
    add_model(ap, "sd15", "cold,warm,restart")
    ap.add_argument("--flags", default="", help="more serve flags (quoted)")
    ap.add_argument("--cache-dir", default="/tmp/start-bench-cache")
    ap.add_argument("--timeout", type=float, default=1800)
    add_outputs(ap, log="start.log")
    args = ap.parse_args()
    name = os.path.basename(os.path.normpath(args.model))
    cache = os.path.join(args.cache_dir, name)
    entry: dict[str, Any] = {"flags": args.flags}
    for part in args.parts.split(","):
        entry.update(run_part(part, args, cache))
        print(json.dumps(write(name, entry, args.out_dir, prefix="start")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
