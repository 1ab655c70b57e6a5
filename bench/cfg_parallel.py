"""CFG-parallel against one GPU: one Wan video's latency through `/v1/videos`, with its time split.

    python bench/cfg_parallel.py            # on a machine with 2 GPUs

The Wan2.1-T2V-1.3B architecture (random weights, bf16, 832x480, 33 frames, 20 steps, CFG 5,
the seeded random prompt embeddings of bench/serving_video.py) served twice, one after the other
on the same machine: one replica on GPU 0, then `--cfg-parallel --devices 0,1` (one replica whose
two ranks each run one guidance branch of every step). Each serves a warm-up video, then
`--runs` videos one at a time: create -> poll every 50 ms -> content. For each video the
server's /metrics, read before and after, split the time:

- denoise: the worker's denoising loop (`batch_phase_seconds{phase="denoise"}`);
- decode: the VAE decode, the frames to the host and the MP4, encoded while the VAE decodes
  (`phase="finish"`);
- encode: what the server process still encodes: the thumbnail (`video_encode_seconds`);
- engine other: the rest of the job's end-to-end time (`e2e_latency_seconds`, which for a video
  job ends once its files are written): queueing, the frames' way from the worker to the server
  process;
- polling and HTTP: what the client waited beyond the job's end-to-end time.

Each worker also writes its batches' device timelines (stages/trace.py: one CUDA event per step,
no profiler): for each setting, the medians over the measured videos of rank 0's first step
(from the pipeline call's start), its later steps, and CFG-parallel rank 1's branch forwards and
its device's idle time between them.

The two servers' MP4s of the same seed are compared (PSNR). Adds `cfg_parallel_denoise_ratio`
and `cfg_parallel_video_latency_ratio` (2 GPUs / 1 GPU, medians) and the detail under
`cfg_parallel` to bench/results/scaleout-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from typing import Any

import httpx
import numpy as np
import raw_diffusers as ref
from cli_flags import add_outputs, parser
from compare import PSNR_MIN_DB, db, psnr
from server_proc import Server

from vllm_omni_like.pipelines.catalog import ARCH_OPTIONS
from vllm_omni_like.stages.trace import TRACE_BATCHES_ENV, TRACE_DIR_ENV
from vllm_omni_like.video_codec import decode_video

HERE = os.path.dirname(os.path.abspath(__file__))
SETTINGS = ("1gpu", "cfg_parallel")
WAN = "wan2.1-t2v-1.3b"
POLL_S = 0.05
PREFIX = "vllm_omni_like_"


def _sum(text: str, metric: str, **labels: str) -> float:
    """The sum of a histogram's `_sum` series whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(f"{PREFIX}{metric}_sum"):
            continue
        head, value = line.rsplit(" ", 1)
        got = dict(re.findall(r'(\w+)="([^"]*)"', head))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(value)
    return total


def scrape(http: httpx.Client) -> dict[str, float]:
    """The sums of the histograms this benchmark splits the time by."""
    text = http.get("/metrics").text
    return {
        "denoise": _sum(text, "batch_phase_seconds", phase="denoise"),
        "decode": _sum(text, "batch_phase_seconds", phase="finish"),
        "encode": _sum(text, "video_encode_seconds"),
        "engine": _sum(text, "e2e_latency_seconds", status="success"),
    }


def one_video(http: httpx.Client, body: dict[str, Any]) -> tuple[dict[str, float], bytes]:
    before = scrape(http)
    t0 = time.perf_counter()
    job = http.post("/v1/videos", json=body).json()
    while job["status"] in ("queued", "in_progress"):
        time.sleep(POLL_S)
        job = http.get(f"/v1/videos/{job['id']}").json()
    if job["status"] != "completed":
        raise RuntimeError(f"video failed: {job}")
    mp4 = http.get(f"/v1/videos/{job['id']}/content").content
    total = time.perf_counter() - t0
    after = scrape(http)
    d = {k: after[k] - before[k] for k in after}
    split = {
        "total_s": total,
        "denoise_s": d["denoise"],
        "decode_s": d["decode"],
        # a video job's end-to-end time ends once its files are written: the encode is in it
        "engine_other_s": d["engine"] - d["denoise"] - d["decode"] - d["encode"],
        "encode_s": d["encode"],
        "polling_http_s": total - d["engine"],
    }
    return {k: round(v, 4) for k, v in split.items()}, mp4


def _gaps(line: dict[str, Any], after: str, before: str) -> list[float]:
    """Milliseconds from each `after` mark to the `before` mark that follows it."""
    out, since = [], None
    for label, ms in zip(line["labels"], line["ms"], strict=True):
        if label == before and since is not None:
            out.append(ms - since)
        since = ms if label == after else since
    return out


def timelines(directory: str, measured: int) -> dict[str, float]:
    """Medians over the last `measured` batches of each rank's timeline (milliseconds): rank 0's
    first step (from the batch's begin), later steps, and its wait for the device after the
    last step; rank 1's branch forwards, its device's idle time between them, and when its first
    branch began on the device, from rank 0's begin (one host clock for both)."""

    def lines(rank: int) -> list[dict[str, Any]]:
        path = os.path.join(directory, f"diffusion-rank{rank}-timeline.jsonl")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [json.loads(x) for x in f.read().splitlines()][-measured:]

    def at(line: dict[str, Any], label: str, clock: str = "ms") -> list[float]:
        return [t for name, t in zip(line["labels"], line[clock], strict=True) if name == label]

    out: dict[str, float] = {}
    leader, served = lines(0), lines(1)
    if leader:
        out["first_step_ms"] = statistics.median(at(b, "step")[0] for b in leader)
        out["step_ms"] = statistics.median(g for b in leader for g in _gaps(b, "step", "step"))
        out["steps_to_synced_ms"] = statistics.median(
            at(b, "synced", "host_ms")[0] - at(b, "step")[-1] for b in leader
        )
    if leader and any("local" in b["labels"] for b in leader):
        out["rank0_branch_ms"] = statistics.median(
            g for b in leader for g in _gaps(b, "local", "local_done")
        )
    if served:
        out["rank1_branch_ms"] = statistics.median(
            g for b in served for g in _gaps(b, "branch", "done")
        )
        out["rank1_idle_ms"] = statistics.median(
            g for b in served for g in _gaps(b, "done", "branch")
        )
    if leader and len(served) == len(leader):
        out["rank1_first_branch_ms"] = statistics.median(
            1000 * (s["t0"] - b["t0"]) + at(s, "branch")[0]
            for b, s in zip(leader, served, strict=True)
        )
    return {k: round(v, 2) for k, v in out.items()}


def serve(label: str, args: argparse.Namespace, body: dict[str, Any], log: str) -> dict[str, Any]:
    flags = [args.model, "--stall-timeout", "600"]
    if args.model == WAN:
        flags += ["--load-format", "dummy", "--dtype", "bf16"]
    if label == "cfg_parallel":
        flags += ["--cfg-parallel", "--devices", args.devices_two]
    else:
        flags += ["--devices", args.devices_one]
    flags += args.server_flags.split()
    traces = tempfile.mkdtemp(prefix="timelines-")
    os.environ[TRACE_DIR_ENV], os.environ[TRACE_BATCHES_ENV] = traces, ""  # no profiler
    server = Server(flags, log, 1800)
    runs, mp4 = [], b""
    try:
        with httpx.Client(base_url=server.url, timeout=900) as http:
            for run in range(1 + args.runs):  # the first one warms up
                split, data = one_video(http, body)
                print(f"{label} run {run}: {split}", file=sys.stderr)
                if run:
                    runs.append(split)
                    mp4 = mp4 or data
    finally:
        server.stop()
    median = {k: round(float(np.median([r[k] for r in runs])), 4) for k in runs[0]}
    steps = timelines(traces, args.runs)
    print(f"{label} device timelines: {steps}", file=sys.stderr)
    return {
        "start_s": round(server.start_s, 1),
        "median": median,
        "device_timelines": steps,
        "runs": runs,
        "mp4": mp4,
    }


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--size", default="832x480", help="WxH (smaller only for smoke runs)")
    ap.add_argument("--frames", type=int, default=33)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--server-flags", default="", help="more `serve` flags for both servers")
    ap.add_argument("--model", default=WAN, help="(tiny-video only for a smoke run on a CPU)")
    ap.add_argument("--devices-one", default="0", help="the one-GPU server's (cpu: smoke run)")
    ap.add_argument("--devices-two", default="0,1", help="the CFG-parallel server's")
    add_outputs(ap, out_dir=os.path.join(HERE, "results"))
    args = ap.parse_args()
    opts = ARCH_OPTIONS[WAN]
    body = {
        "prompt": ref.PROMPT,
        "size": args.size,
        "num_frames": args.frames,
        "fps": 16,
        "seed": 0,
        "num_inference_steps": args.steps,
        "guidance_scale": opts["default_guidance"],
    }
    device = ref.device_name()
    log = os.path.join(args.out_dir, f"cfg_parallel-{device}.log")
    found = {label: serve(label, args, body, log) for label in SETTINGS}
    one, two = found["1gpu"]["median"], found["cfg_parallel"]["median"]
    a, b = (decode_video(found[k].pop("mp4")) for k in SETTINGS)
    value = psnr(a, b) if a.shape == b.shape else -np.inf
    report = {
        "cfg_parallel_denoise_ratio": round(two["denoise_s"] / one["denoise_s"], 4),
        "cfg_parallel_video_latency_ratio": round(two["total_s"] / one["total_s"], 4),
        "cfg_parallel": {
            "gpu": ref.gpu_name(),
            "workload": {**body, "model": args.model, "dtype": "bf16" if args.model == WAN else ""},
            "runs": args.runs,
            "mp4_psnr_db": db(value),
            "videos_equal": value >= PSNR_MIN_DB,
            **found,
        },
    }
    path = os.path.join(args.out_dir, f"scaleout-{device}.json")
    existing: dict[str, Any] = {}
    if os.path.exists(path):
        with open(path) as f:
            existing = json.load(f)
    existing.update(report)
    with open(path, "w") as f:
        json.dump(existing, f, indent=2)
    print(json.dumps({k: v for k, v in report.items() if k != "cfg_parallel"}))
    print(json.dumps({"1gpu": one, "cfg_parallel": two, "psnr": db(value)}))
    print(json.dumps({k: found[k]["device_timelines"] for k in SETTINGS}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
