"""Where a step-level server's time goes, and the GPU-only ceiling it is measured against (#36).

- `step_timeline`: from the step server's timeline (`stages/trace.py`): the median step at
  each set size, stalls, idle time between sets, the images a second the device's steps made.
- `part_ceiling`: the SD1.5 UNet compiled at 32 images (64 CFG rows) and the VAE decoder
  compiled at 32, no server: 32 / (30 x step + decode) img/s; `decode_curve`: the eager VAE
  decode of 1 .. 32 rows (what sets `--decode-group-rows`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
from typing import Any


def read_timeline(directory: str) -> list[dict[str, Any]]:
    """Every set of the rank-0 timelines in `directory` (stages/trace.py), as written, but for
    those that ran under the profiler."""
    sets: list[dict[str, Any]] = []
    for name in os.listdir(directory):
        if name.endswith("-rank0-timeline.jsonl"):
            with open(os.path.join(directory, name)) as f:
                sets += (line for line in map(json.loads, f) if not line.get("traced"))
    return sets


def step_timeline(directory: str, steps: int, since: float) -> dict[str, Any]:
    """Where the step-level server's time went, from its timeline (each set, first join to
    drain: every step's end on the device's clock and the requests it ran; sets that began
    before `since` - the warm-up's, on the same monotonic clock - left out): the median step
    at each set size, the steps over twice their size's median (stalls), the idle time between
    one set's drain and the next set's start, and the images a second the device's steps made
    (the requests each step ran over its duration, / `steps`)."""
    sets = sorted(
        (line for line in read_timeline(directory) if line["t0"] >= since),
        key=lambda line: line["t0"],
    )
    per_rows: dict[int, list[float]] = {}
    leads: list[float] = []  # a set's start to its first step's end
    joins: list[float] = []  # each join's own time (its text encoders and noise)
    for line in sets:
        timed = list(zip(line["labels"], line["ms"], strict=True))
        leads += [at for label, at in timed if label == "step"][:1]
        pairs = itertools.pairwise(timed)
        joins += [at - before for (_, before), (label, at) in pairs if label == "joined"]
        marks = list(zip(line["labels"], line["ms"], line.get("rows", []), strict=False))
        for (_, before, _), (label, at, rows) in itertools.pairwise(marks):
            if label == "step" and rows:
                per_rows.setdefault(rows, []).append(at - before)
    medians = {r: statistics.median(v) for r, v in per_rows.items()}
    stalls = [t for r, v in per_rows.items() for t in v if t > 2 * medians[r]]
    gaps = [
        nxt["t0"] - (prev["t0"] + prev["ms"][-1] / 1000) for prev, nxt in itertools.pairwise(sets)
    ]
    busy = sum(sum(v) for v in per_rows.values()) / 1000
    row_steps = sum(r * len(v) for r, v in per_rows.items())
    alloc: dict[str, int] = {}
    for line in sets:  # (CUDA: the caching allocator's retries, mallocs and frees meanwhile)
        for k, v in line.get("alloc", {}).items():
            alloc[k] = alloc.get(k, 0) + v
    return {
        "sets": len(sets),
        "alloc": alloc,
        "step_ms_by_rows": {r: round(medians[r], 2) for r in sorted(medians)},
        "steps_by_rows": {r: len(per_rows[r]) for r in sorted(per_rows)},
        "stalls_ms": [round(t, 1) for t in stalls],
        # the first rows' text encoders, noise and first step; a join's encoders and noise
        "lead_ms": round(statistics.median(leads), 2) if leads else None,
        "join_ms": round(statistics.median(joins), 2) if joins else None,
        "between_sets_s": [round(g, 3) for g in gaps],
        "device_img_s": round(row_steps / busy / steps, 3) if busy else None,
    }


def host_spans(directory: str, spans: list[tuple[float, float]]) -> dict[str, float]:
    """Where the host's time went for requests sent one at a time (`spans`: each request's send
    and its response's end on the machine's monotonic clock, which the timeline's `t0` is on):
    the medians, in ms, of the send to its set's begin (HTTP, API, engine, worker, its join),
    the begin to the set's last mark (the wait for the device after the last step) and that
    mark to the response's end (the hand-over, decode, image encode, HTTP)."""
    sets = read_timeline(directory)
    parts: dict[str, list[float]] = {"to_begin": [], "begin_to_synced": [], "synced_to_end": []}
    for sent, ended in spans:
        inside = [line for line in sets if sent <= line["t0"] <= ended]
        if len(inside) != 1:  # (not one set for one request: not comparable)
            continue
        line = inside[0]
        synced = line["t0"] + line["host_ms"][-1] / 1000
        parts["to_begin"].append((line["t0"] - sent) * 1000)
        parts["begin_to_synced"].append(line["host_ms"][-1])
        parts["synced_to_end"].append((ended - synced) * 1000)
    return {k: round(statistics.median(v), 2) for k, v in parts.items() if v}


def part_ceiling(args: argparse.Namespace) -> dict[str, Any]:
    """The compiled UNet at 32 images (64 CFG rows) and the VAE decoder at 32, no server."""
    import torch

    from bench.raw_diffusers import build

    pipe = build("sd15", "fp16", "cuda", compile_unet=True)
    eager_decode = pipe.vae.decode
    pipe.vae.decode = torch.compile(pipe.vae.decode, dynamic=False)
    n, side = 32, 512 // 8
    latents = torch.randn(2 * n, 4, side, side, device="cuda", dtype=torch.float16)
    text = torch.randn(2 * n, 77, 768, device="cuda", dtype=torch.float16)
    t = torch.full((2 * n,), 500, device="cuda")
    with torch.inference_mode():
        for _ in range(3):  # compile, then warm
            pipe.unet(latents, t, encoder_hidden_states=text)
            pipe.vae.decode(latents[:n])
        torch.cuda.synchronize()
        steps = []
        for _ in range(args.ceiling_steps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            pipe.unet(latents, t, encoder_hidden_states=text)
            b.record()
            b.synchronize()
            steps.append(a.elapsed_time(b) / 1000)
        decodes = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            pipe.vae.decode(latents[:n])
            b.record()
            b.synchronize()
            decodes.append(a.elapsed_time(b) / 1000)
    step, decode = statistics.median(steps), statistics.median(decodes)
    return {
        "ceiling_step_s": round(step, 5),
        "ceiling_decode_32_s": round(decode, 4),
        "gpu_ceiling_img_s": round(n / (30 * step + decode), 3),
        "decode_rows_s": decode_curve(eager_decode, latents),
    }


def decode_curve(decode: Any, latents: Any) -> dict[int, float]:
    """The VAE decode (eager: one graph a size would take minutes to compile) of 1 .. 32 rows:
    what a decode group of K rows costs a row against a decode of 32 (`--decode-group-rows`)."""
    import torch

    curve = {}
    with torch.inference_mode():
        for rows in (1, 2, 4, 8, 16, 32):
            times = []
            for i in range(6):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                decode(latents[:rows])
                b.record()
                b.synchronize()
                if i:  # (the first: warm-up)
                    times.append(a.elapsed_time(b) / 1000)
            curve[rows] = round(statistics.median(times), 5)
    return curve
