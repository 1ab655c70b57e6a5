"""No regression from a change of the model layer: this tree against an older checkout, on one GPU.

    python bench/family_regression.py --before OLD_CHECKOUT --parts sd15-eager,sd15-compiled,wan

For each part, both trees' servers start once on the same GPU (`--gpu-memory-fraction 0.45`
each, random weights) and their runs alternate, old then new, round after round:
  - batch 1: one request at a time (--batch1 a round, the trees request by request); each
    step's device time from the worker's timeline (CUDA events, VLLM_OMNI_LIKE_TRACE_DIR:
    stages/trace.py): the host's launch speed cancels out where the host runs ahead of the
    device (a large model); the median step of every batch, then the median over the batches;
  - c32 (images): 32 clients, img/s per round (its spread: every round's figure);
  - the video (Wan2.1-T2V-1.3B, 832x480, 33 frames, 20 steps): per-step device time and the
    end-to-end seconds of create -> poll -> content.
Prints one JSON line per part (and appends it to --out): `new_over_old` for each figure.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.memory import load, sd15_args
from bench.server_proc import Server

FRACTION = 0.45
WAN = ["wan2.1-t2v-1.3b", "--load-format", "dummy", "--dtype", "bf16", "--stall-timeout", "300"]


TINY = ["--max-batch-size", "32", "--max-queue-size", "4096", "--max-queue-seconds", "0"]
SD15_BODY = {"prompt": "a photo of a cat", "size": "512x512", "num_inference_steps": 20}
# each part: server flags, one request's body, and whether it is a video
PARTS: dict[str, tuple[list[str], dict[str, Any], bool]] = {
    "sd15-eager": (sd15_args(FRACTION), SD15_BODY, False),
    # the buckets c32 and batch 1 use: 2 graphs a tree
    "sd15-compiled": (
        [*sd15_args(FRACTION), "--compile", "--batch-buckets", "1,32"],
        SD15_BODY,
        False,
    ),
    "wan": (
        [*WAN, "--gpu-memory-fraction", str(FRACTION)],
        {"prompt": "a cat", "size": "832x480", "num_frames": 33},
        True,
    ),
    # smoke runs of the bench itself on a CPU
    "tiny-image": (
        ["tiny-image", *TINY],
        {"prompt": "a red circle", "num_inference_steps": 4},
        False,
    ),
    "tiny-video": (
        ["tiny-video"],
        {"prompt": "a red square", "num_frames": 9, "num_inference_steps": 4},
        True,
    ),
}


class Tree:
    """One tree's server with its own timeline directory."""

    def __init__(self, name: str, args: list[str], log: str, tree: str | None) -> None:
        self.name = name
        self.traces = tempfile.mkdtemp(prefix=f"timeline-{name}-")
        env = dict(
            os.environ, VLLM_OMNI_LIKE_TRACE_DIR=self.traces, VLLM_OMNI_LIKE_TRACE_BATCHES=""
        )
        cwd = None
        if tree is not None:  # its package first on the path, run from its folder
            cwd = os.path.abspath(tree)
            env["PYTHONPATH"] = cwd + os.pathsep + env.get("PYTHONPATH", "")
        self.server = Server(args, f"{log}.{name}", 1200, env=env, cwd=cwd)
        self.steps_ms: list[float] = []  # each batch-1 batch's median step
        self.c32: list[float] = []
        self.video_s: list[float] = []

    def timeline_lines(self) -> list[dict[str, Any]]:
        lines = []
        for name in os.listdir(self.traces):
            if name.endswith("-rank0-timeline.jsonl"):
                with open(os.path.join(self.traces, name)) as f:
                    lines += [json.loads(line) for line in f]
        return sorted(lines, key=lambda line: line["t0"])

    def median_step(self, since: int) -> float:
        """The median step of the batches after the first `since` of the timeline."""
        line = self.timeline_lines()[since:][-1]
        at = [ms for label, ms in zip(line["labels"], line["ms"], strict=True) if label == "step"]
        return statistics.median(b - a for a, b in itertools.pairwise(at))


def image_once(tree: Tree, body: dict[str, Any]) -> None:
    r = httpx.post(
        f"{tree.server.url}/v1/images/generations", json={**body, "seed": 1}, timeout=600
    )
    r.raise_for_status()


def video_once(tree: Tree, body: dict[str, Any]) -> float:
    url = tree.server.url
    t0 = time.perf_counter()
    job = httpx.post(f"{url}/v1/videos", json={**body, "seed": 1}, timeout=60)
    job.raise_for_status()
    vid = job.json()["id"]
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        status = httpx.get(f"{url}/v1/videos/{vid}", timeout=60).json()["status"]
        if status in ("completed", "failed"):
            break
        time.sleep(0.05)
    if status != "completed":
        raise RuntimeError(f"{tree.name}: video {vid} {status}")
    httpx.get(f"{url}/v1/videos/{vid}/content", timeout=60).raise_for_status()
    return time.perf_counter() - t0


def batch_one(tree: Tree, body: dict[str, Any], video: bool) -> None:
    seen = len(tree.timeline_lines())
    if video:
        tree.video_s.append(video_once(tree, body))
    else:
        image_once(tree, body)
    deadline = time.monotonic() + 30  # the timeline line is written as the batch ends
    while len(tree.timeline_lines()) <= seen and time.monotonic() < deadline:
        time.sleep(0.05)
    tree.steps_ms.append(tree.median_step(seen))


def ratio(new: list[float], old: list[float]) -> float:
    return round(statistics.median(new) / statistics.median(old), 4)


def run_part(part: str, args: argparse.Namespace) -> dict[str, Any]:
    flags, body, video = PARTS[part]
    cpu = part.startswith("tiny")  # memory.load's tiny-image requests
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both load (and compile) at once
        starting = [
            pool.submit(Tree, "old", flags, args.log, args.before),
            pool.submit(Tree, "new", flags, args.log, None),
        ]
        started = [f.result() for f in starting]  # (a start that failed raises here)
    old, new = started
    trees = (old, new)
    try:
        for tree in trees:  # warm-up: cuDNN, the allocator's pool
            (video_once if video else image_once)(tree, body)
            if not video:
                asyncio.run(load(tree.server.url, 32, 64, cpu=cpu, oom_share=0))
        for _ in range(args.rounds):
            for _ in range(args.batch1):  # request by request, old then new
                for tree in trees:
                    batch_one(tree, body, video)
            for tree in trees:
                if not video:
                    out = asyncio.run(load(tree.server.url, 32, args.c32_requests, cpu, 0))
                    if out["failed"]:
                        raise RuntimeError(f"{tree.name} c32 failed: {out['errors']}")
                    tree.c32.append(round(out["images"] / out["seconds"], 3))
    finally:
        for tree in trees:
            tree.server.stop()
    result: dict[str, Any] = {"part": part, "rounds": args.rounds}
    for tree in trees:
        result[tree.name] = {"step_ms": [round(s, 3) for s in tree.steps_ms]}
        if tree.c32:
            result[tree.name]["c32_img_s"] = tree.c32
        if tree.video_s:
            result[tree.name]["video_s"] = [round(s, 3) for s in tree.video_s]
    result["new_over_old"] = {"step_ms": ratio(new.steps_ms, old.steps_ms)}
    if new.c32:
        result["new_over_old"]["c32_img_s"] = ratio(new.c32, old.c32)
    if new.video_s:
        result["new_over_old"]["video_s"] = ratio(new.video_s, old.video_s)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="the older checkout")
    ap.add_argument("--parts", default="sd15-eager,sd15-compiled,wan")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--c32-requests", type=int, default=96)
    ap.add_argument("--batch1", type=int, default=3, help="batch-1 requests a tree a round")
    ap.add_argument("--log", default="family_regression.log")
    ap.add_argument("--out", default="", help="a JSON-lines file to append each part to")
    args = ap.parse_args()
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    for part in args.parts.split(","):
        result = {"device": device, **run_part(part, args)}
        print(json.dumps(result), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
