"""The step cache's speed on one GPU (#58): First-Block Cache a row at a time in our own loop,
at batch 1 and batched, against no caching and against diffusers' own FirstBlockCacheConfig.

    # one H100, a call each (10 minutes at most); each call merges its parts into the file
    python bench/caching.py --models flux.1-dev --concurrency 4            # b1, c4, diffusers
    python bench/caching.py --models flux.1-dev --concurrency 16 --parts batched
    python bench/caching.py --models wan2.2-ti2v-5b --concurrency 4
    python bench/caching.py --models wan2.2-ti2v-5b --concurrency 16 --parts batched
    python bench/caching.py --tiny --device cpu --concurrency 2 --steps 4  # a CPU smoke

One diffusion stage a model in this process (the shipped architecture, `--load-format dummy`:
random weights) with `--cache first-block`. Random weights make the residual's test arbitrary,
so the benchmark fixes which steps each row skips (`FirstBlockCache.forced`): staggered, a row
computes its first step and then every other step, rows alternating in phase, so about half of
the rows compute at each step (`skipped_share` reports the share of block evaluations skipped).
- b1: one request, cached against uncached (the wrappers out of the blocks), the denoise phase
  (the loop, to the device's end) and end to end (with the decode): `speedup_b1`; also with
  `--cache-decision lagged` (`lagged`: the same decisions, the change read without waiting
  for the device: what the sync decision's one read a step costs). Each measurement follows
  one untimed run of two steps; `--repeats` timed runs (default 1), the fastest kept.
- batched: N requests in one set of our loop (what a step-level running set of N runs each
  step: the computing half as a sub-batch padded to a bucket), cached against uncached:
  `speedup_batched` {cN: {denoise, e2e}}.
- diffusers: the pipeline's own call at batch 1 with `transformer.enable_cache(
  FirstBlockCacheConfig())`, its decision replaced by the same schedule (the same skip share),
  against the same call without it: `diffusers_fbcache_speedup_b1`.
- `tiny_block_evals_saved_at_accuracy`: the share saved at the default decision's default
  threshold on the trained tiny-video (bench/cache_quality.py's result for the device, where
  it ran).
Writes bench/results/caching-<device>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vllm_omni_like.config import StageConfig
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.pipelines.catalog import ARCH_OPTIONS, arch_path
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.diffusion.block_cache import RowCache
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.wire import StageRequest

# the shapes: FLUX.1-dev at 1024x1024, 28 steps; Wan2.2-TI2V-5B at 832x480, 33 frames
MODELS = {
    "flux.1-dev": {"width": 1024, "height": 1024, "steps": 28},
    "wan2.2-ti2v-5b": {"width": 832, "height": 480, "steps": 28, "frames": 33},
}
TINY = {"tiny-video": {"width": 64, "height": 64, "steps": 8, "frames": 9}}


class Staggered:
    """A row computes its first step, then every other one; rows alternate in phase."""

    def __init__(self) -> None:
        self.phase: dict[int, int] = {}

    def __call__(self, row: RowCache) -> bool:
        phase = self.phase.setdefault(id(row), len(self.phase) % 2)
        return (row.steps + phase) % 2 == 0


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(stage: DiffusionStage, batch: list[StageRequest]) -> tuple[float, float]:
    """(denoise seconds, end-to-end seconds) of one batch through our loop."""
    device = stage.runtime.device
    sync(device)
    began = time.perf_counter()
    part = stage.begin(batch, StageControl(FaultInjector((), "diffusion")))
    sync(device)
    denoised = time.perf_counter()
    outs = part.finish(batch)
    sync(device)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return denoised - began, time.perf_counter() - began


def requests(shape: dict[str, Any], n: int, video: bool) -> list[StageRequest]:
    mode = "text2video" if video else "text2img"
    return [
        StageRequest(
            f"r{i}",
            "a red circle moving right on a blue background",
            GenerationParams(
                width=shape["width"],
                height=shape["height"],
                num_inference_steps=shape["steps"],
                num_frames=shape.get("frames") if video else None,
                seed=i,
            ),
            mode=mode,
        )
        for i in range(n)
    ]


def best(stage, batch, repeats: int) -> tuple[float, float]:
    """The fastest of `repeats` timed runs."""
    runs = [timed(stage, batch) for _ in range(repeats)]
    return min(r[0] for r in runs), min(r[1] for r in runs)


def warm(stage, batch) -> None:
    """One untimed run of two steps (the allocator's pools, the kernels' first launches)."""
    short = [
        dataclasses.replace(r, params=dataclasses.replace(r.params, num_inference_steps=2))
        for r in batch
    ]
    timed(stage, short)


def ours(stage: DiffusionStage, batch, repeats: int, lagged: bool) -> dict[str, Any]:
    """Cached (the staggered schedule) against uncached, the same batch (`lagged`: also with
    the decision read a step late: the same skips, no wait for the device)."""
    cache = stage.runtime.denoise.cache
    warm(stage, batch)
    with cache.unwrapped():
        plain = best(stage, batch, repeats)
    cache.forced, cache.evaluations, cache.saved = Staggered(), 0, 0
    try:
        cached = best(stage, batch, repeats)
        skipped = cache.saved_share
        cache.lagged = True
        late = best(stage, batch, repeats) if lagged else None
    finally:
        cache.forced, cache.lagged = None, False
    figures: dict[str, Any] = {
        "skipped_share": round(skipped, 4),
        "denoise": round(plain[0] / cached[0], 3),
        "e2e": round(plain[1] / cached[1], 3),
        "seconds": {"uncached": plain, "cached": cached},
    }
    if late is not None:
        figures["lagged"] = {
            "denoise": round(plain[0] / late[0], 3),
            "e2e": round(plain[1] / late[1], 3),
        }
        figures["seconds"]["lagged"] = late
    return figures


def diffusers_fbc(stage: DiffusionStage, batch: list[StageRequest], repeats: int) -> dict:
    """The pipeline's own call (the stage's other path) at batch 1, with diffusers' First-Block
    Cache on the same schedule (its decision replaced: each cache context's first step
    computes, then every other one), against the same call without it."""
    from diffusers.hooks import FirstBlockCacheConfig, HookRegistry

    rt = stage.runtime
    own, rt.own = rt.own, set()
    try:
        with rt.denoise.cache.unwrapped():
            plain = best(stage, batch, repeats)
            rt.pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.0))
            head = rt.adapter.block_stack().blocks[0]
            registry = HookRegistry.check_if_exists_or_initialize(head)
            hook = registry.get_hook("fbc_leader_block_hook")

            def decide(residual: torch.Tensor) -> bool:
                state = hook.state_manager.get_state()
                n = 1 if state.tail_block_residuals is None else state.bench_steps + 1
                state.bench_steps = n
                return n % 2 == 1

            hook._should_compute_remaining_blocks = decide
            try:
                cached = best(stage, batch, repeats)
            finally:
                rt.pipe.transformer.disable_cache()
    finally:
        rt.own = own
    return {
        "denoise": round(plain[0] / cached[0], 3),
        "e2e": round(plain[1] / cached[1], 3),
        "seconds": {"uncached": plain, "cached": cached},
    }


def tiny_saved(device: str) -> float | None:
    path = f"bench/results/cache_quality-{device}.json"
    if not os.path.exists(path):
        return None
    decision = StageConfig.__dataclass_fields__["cache_decision"].default  # (the served one)
    with open(path) as f:
        default = json.load(f)["default"].get(decision)
    return None if default is None else default["block_evals_saved"]


def bench(name: str, shape: dict[str, Any], args) -> dict[str, Any]:
    tiny = name.startswith("tiny-")
    stage = DiffusionStage(
        StageConfig(
            name="diffusion",
            kind="diffusion",
            model=name if tiny else arch_path(name),
            load_format="auto" if tiny else "dummy",
            dtype=args.dtype,
            device=args.device,
            compile=args.compile,
            max_batch_size=max(args.concurrency),
            cache="first-block",
            cache_decision="sync",  # (`ours` times lagged beside it, the same skips)
            options={} if tiny else ARCH_OPTIONS[name],
        )
    )
    stage.load(args.device)
    video = stage.runtime.is_video
    one = requests(shape, 1, video)
    result: dict[str, Any] = {"shape": shape}
    if "b1" in args.parts:
        result["speedup_b1"] = ours(stage, one, args.repeats, lagged=True)
        result["skipped_share"] = result["speedup_b1"]["skipped_share"]
    if "batched" in args.parts:
        result["speedup_batched"] = {
            f"c{n}": ours(stage, requests(shape, n, video), args.repeats, lagged=False)
            for n in args.concurrency
        }
    if "diffusers" in args.parts:
        result["diffusers_fbcache_speedup_b1"] = diffusers_fbc(stage, one, args.repeats)
    result["tiny_block_evals_saved_at_accuracy"] = tiny_saved(stage.runtime.device.type)
    stage.close()
    print(json.dumps({name: result}), flush=True)
    return result


def device_tag(device: str) -> str:
    """cpu, or the GPU's model (h100, h200, ...)."""
    if device == "cpu" or not torch.cuda.is_available():
        return "cpu"
    words = torch.cuda.get_device_name(0).lower().split()
    return next((w for w in words if w[:1] in "ahlb" and w[1:2].isdigit()), "cuda")


def merged(out: str, device: str, compile_: bool, results: dict[str, Any]) -> dict[str, Any]:
    """The results file with these parts merged in (calls of one device add up)."""
    found: dict[str, Any] = {"device": device, "compile": compile_, "models": {}}
    if os.path.exists(out):
        with open(out) as f:
            found = json.load(f)
    for name, parts in results.items():
        found["models"].setdefault(name, {}).update(parts)
        speeds = found["models"][name].get("speedup_batched")
        if speeds is not None and "speedup_batched" in parts:
            speeds.update(parts["speedup_batched"])
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tiny", action="store_true", help="the tiny-video model (a CPU smoke)")
    ap.add_argument("--concurrency", default="4,16")
    ap.add_argument("--parts", default="b1,batched,diffusers")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--steps", type=int, default=None, help="(default: each model's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    shapes = TINY if args.tiny else {m: MODELS[m] for m in args.models.split(",")}
    if args.steps is not None:
        shapes = {name: {**shape, "steps": args.steps} for name, shape in shapes.items()}
    args.parts = set(args.parts.split(","))
    results = {name: bench(name, shape, args) for name, shape in shapes.items()}
    device = device_tag(args.device)
    out = args.out or f"bench/results/caching-{device}.json"
    found = merged(out, device, args.compile, results)
    with open(out, "w") as f:
        json.dump(found, f, indent=1)
    print(json.dumps({"out": out}))


if __name__ == "__main__":
    main()
