"""What `--offload idle-expert` costs a two-expert video model (Wan2.2-A14B) at its switch (#56
item 5): one request's steps timed on the device across the high-to-low-noise switch.

    python bench/offload.py                                  # A14B, --offload idle-expert
    python bench/offload.py --offload none                   # both experts resident (H200)
    python bench/offload.py --prefetch-units 0               # the swap without its prefetch
    python bench/offload.py --model /tmp/tiny-wan22-experts --offload none --dtype fp32 \\
        --size 64x64 --frames 5 --steps 4                    # the CPU smoke run

The stage is loaded in this process as a worker loads it (`serve <model> --load-format dummy
--offload <mode> --shape-groups 1`: random weights, eager; the offload refuses --compile), at
`--size`, `--frames`, `--steps` and CFG `--guidance` (two forwards a step). A request's rows
go through the stage's running set (`OwnLoopSet`, no decode), a CUDA event after each step: each
step's milliseconds on the device and the expert that ran it. `--runs` requests one after another:
the first request's switch has the prefetch (the last high-noise step copies the low-noise
expert's first blocks), the next request's first step brings the high-noise expert back cold
(the set was empty: nothing predicted it).

Writes `bench/results/offload-<device>.json`, `models.<name>.<mode>`: `step_ms` and `experts`
(each run's), `switch_step` (the first low-noise step), `switch_step_ms`, `low_median_ms` (the
other low-noise steps), `switch_cost_ms` (their difference: what the step after the switch
waited), `cold_first_step_ms` / `high_median_ms` (a later run's first step, the expert brought
back without a prefetch), `last_swap_copy_s` (the copy stream's time of the last swap),
`swaps`, `gpu_memory_after_load_gib`, `peak_gpu_memory_gib`, `expert_gib`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import itertools

from bench.raw_diffusers import DTYPES, PROMPT, merge_result


def stage_for(args: argparse.Namespace) -> Any:
    """The stage `serve <model> --load-format dummy --offload <mode>` builds, loaded here."""
    from vllm_omni_like.pipelines.catalog import resolve
    from vllm_omni_like.stages.base import create_stage

    kw = {"load_format": "dummy", "dtype": args.dtype, "offload": args.offload}
    kw["shape_groups"] = 1  # (--offload idle-expert runs one lane of the running set)
    config = resolve(args.model, **kw)[0].stages[-1]
    width, height = map(int, args.size.split("x"))
    config = dataclasses.replace(config, max_side=max(width, height, 64), max_frames=args.frames)
    stage = create_stage(config)
    stage.load("cuda" if torch.cuda.is_available() else "cpu")
    return stage


def run_request(stage: Any, args: argparse.Namespace, seed: int) -> tuple[list[float], list[int]]:
    """One request's steps through the running set: each step's device milliseconds (host
    milliseconds on the CPU) and the expert that ran it."""
    from vllm_omni_like.params import GenerationParams
    from vllm_omni_like.stages.base import StageControl
    from vllm_omni_like.stages.diffusion.running_set import OwnLoopSet
    from vllm_omni_like.stages.faults import FaultInjector
    from vllm_omni_like.wire import StageRequest

    width, height = map(int, args.size.split("x"))
    params = GenerationParams(
        seed=seed,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        width=width,
        height=height,
        num_frames=args.frames,
    )
    request = StageRequest(f"r{seed}", PROMPT, params, mode="text2video")
    control = StageControl(FaultInjector((), "diffusion"))
    rt = stage.runtime
    rowset = OwnLoopSet(rt)
    rowset.join([request], control)
    marks, experts = [_mark()], []
    for _ in range(args.steps + 1):  # (bounded: one step a schedule entry)
        row = rowset.set.rows[0]
        if row.state.done:
            break
        experts.append(rt.adapter.expert_for(float(row.state.timestep)))
        if not rowset.step(control):
            break
        marks.append(_mark())
    rowset.drained()
    rowset.set.let_go()
    return _elapsed(marks), experts


def _mark() -> Any:
    if not torch.cuda.is_available():
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _elapsed(marks: list[Any]) -> list[float]:
    if not torch.cuda.is_available():
        return [round((b - a) * 1000, 3) for a, b in itertools.pairwise(marks)]
    torch.cuda.synchronize()
    return [round(a.elapsed_time(b), 3) for a, b in itertools.pairwise(marks)]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from vllm_omni_like.stages.diffusion.quantize import model_bytes

    t0 = time.perf_counter()
    stage = stage_for(args)
    load_s = time.perf_counter() - t0
    if (offload := stage.runtime.denoise.offload) is not None:
        offload.prefetch_units = args.prefetch_units
    cuda = torch.cuda.is_available()
    after_load = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    experts = stage.runtime.adapter.experts()
    runs = [run_request(stage, args, seed) for seed in range(args.runs)]
    result: dict[str, Any] = {
        "load_s": round(load_s, 1),
        "size": args.size,
        "frames": args.frames,
        "steps": args.steps,
        "prefetch_units": args.prefetch_units,
        "step_ms": [ms for ms, _ in runs],
        "experts": [e for _, e in runs],
        "expert_gib": round(model_bytes(experts[-1].model) / 2**30, 3),
        "gpu_memory_after_load_gib": round(after_load / 2**30, 3),
    }
    if cuda:
        result["peak_gpu_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    result |= switch_costs(runs)
    if offload is not None:
        report = offload.report()
        result |= {"swaps": report.swaps, "last_swap_copy_s": report.last_swap_s}
        result["host_gib"] = round(report.host_bytes / 2**30, 3)
    return result


def switch_costs(runs: list[tuple[list[float], list[int]]]) -> dict[str, Any]:
    """The first run's switch step against its other low-noise steps; a later run's first step
    (the high-noise expert back, cold) against its other high-noise steps."""
    found: dict[str, Any] = {}
    ms, experts = runs[0]
    if 1 in experts and 0 in experts:
        k = experts.index(1)
        others = [t for t, e in zip(ms, experts, strict=True) if e == 1][1:]
        found["switch_step"], found["switch_step_ms"] = k, ms[k]
        if others:
            found["low_median_ms"] = statistics.median(others)
            found["switch_cost_ms"] = round(ms[k] - found["low_median_ms"], 3)
    if len(runs) > 1:
        ms, experts = runs[1]
        highs = [t for t, e in zip(ms, experts, strict=True) if e == 0][1:]
        found["cold_first_step_ms"] = ms[0]
        if highs:
            found["high_median_ms"] = statistics.median(highs)
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="wan2.2-t2v-a14b")
    ap.add_argument("--offload", default="idle-expert", choices=("none", "idle-expert"))
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--size", default="832x480", help="WxH")
    ap.add_argument("--frames", type=int, default=81)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--guidance", type=float, default=4.0)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--prefetch-units", type=int, default=2, help="0: no prefetch")
    ap.add_argument("--out-dir", default="bench/results")
    args = ap.parse_args()
    found = measure(args)
    name = os.path.basename(args.model.rstrip("/"))
    key = args.offload + ("" if args.prefetch_units == 2 else f"-prefetch{args.prefetch_units}")
    with merge_result("offload", name, {key: found}, args.out_dir) as merged:
        pass
    print(json.dumps(merged[key], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
