"""The step cache's speed on one GPU (#58): First-Block Cache a row at a time in our own loop,
at batch 1 and batched, against no caching and against diffusers' own FirstBlockCacheConfig.

    python bench/caching.py                                   # FLUX.1-dev and Wan2.2-TI2V-5B
    python bench/caching.py --models flux.1-dev --concurrency 4,16 --compile
    python bench/caching.py --tiny --device cpu               # a CPU smoke run of the bench

One diffusion stage a model in this process (the shipped architecture, `--load-format dummy`:
random weights) with `--cache first-block`. Random weights make the residual's test arbitrary,
so the benchmark fixes which steps each row skips (`FirstBlockCache.forced`): staggered, a row
computes its first step and then every other step, rows alternating in phase, so about half of
the rows compute at each step (`skipped_share` reports the share of block evaluations skipped).
- b1: one request, cached against uncached (the wrappers out of the blocks), the denoise phase
  (the loop, to the device's end) and end to end (with the decode): `speedup_b1`; each also
  with `--cache-decision lagged` (`lagged`: the same decisions, the change read without
  waiting for the device: what the sync decision's one read a step costs).
- batched: N requests in one set of our loop (what a step-level running set of N runs each
  step: the computing half as a sub-batch padded to a bucket), cached against uncached:
  `speedup_batched` {cN: {denoise, e2e}}.
- diffusers: the pipeline's own call at batch 1 with `transformer.enable_cache(
  FirstBlockCacheConfig())`, its decision replaced by the same schedule (the same skip share),
  against the same call without it: `diffusers_fbcache_speedup_b1`.
- `tiny_block_evals_saved_at_accuracy`: the share saved at the default threshold on the
  trained tiny-video (bench/cache_quality.py's result for the device, where it ran).
Writes bench/results/caching-<device>.json.
"""

from __future__ import annotations

import argparse
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
    """The fastest of `repeats` timed runs, after one untimed (allocator, kernels, caches)."""
    timed(stage, batch)
    runs = [timed(stage, batch) for _ in range(repeats)]
    return min(r[0] for r in runs), min(r[1] for r in runs)


def ours(stage: DiffusionStage, batch, repeats: int) -> dict[str, Any]:
    """Cached (the staggered schedule) against uncached, the same batch."""
    cache = stage.runtime.denoise.cache
    with cache.unwrapped():
        plain = best(stage, batch, repeats)
    cache.forced, cache.evaluations, cache.saved = Staggered(), 0, 0
    cached = best(stage, batch, repeats)
    skipped = cache.saved_share
    cache.lagged = True  # the same decisions, the change read without a wait
    try:
        lagged = best(stage, batch, repeats)
    finally:
        cache.forced, cache.lagged = None, False
    return {
        "skipped_share": round(skipped, 4),
        "denoise": round(plain[0] / cached[0], 3),
        "e2e": round(plain[1] / cached[1], 3),
        "lagged": {
            "denoise": round(plain[0] / lagged[0], 3),
            "e2e": round(plain[1] / lagged[1], 3),
        },
        "seconds": {"uncached": plain, "cached": cached, "lagged": lagged},
    }


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
    with open(path) as f:
        default = json.load(f)["default"].get("sync")
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
            options={} if tiny else ARCH_OPTIONS[name],
        )
    )
    stage.load(args.device)
    video = stage.runtime.is_video
    b1 = ours(stage, requests(shape, 1, video), args.repeats)
    batched = {
        f"c{n}": ours(stage, requests(shape, n, video), args.repeats) for n in args.concurrency
    }
    result = {
        "shape": shape,
        "skipped_share": b1["skipped_share"],
        "speedup_b1": b1,
        "speedup_batched": batched,
        "diffusers_fbcache_speedup_b1": diffusers_fbc(
            stage, requests(shape, 1, video), args.repeats
        ),
        "tiny_block_evals_saved_at_accuracy": tiny_saved(stage.runtime.device.type),
    }
    stage.close()
    print(json.dumps({name: result}), flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--tiny", action="store_true", help="the tiny-video model (a CPU smoke)")
    ap.add_argument("--concurrency", default="4,16")
    ap.add_argument("--repeats", type=int, default=3)
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
    results = {name: bench(name, shape, args) for name, shape in shapes.items()}
    device = "cpu" if args.device == "cpu" else torch.cuda.get_device_name(0).split()[-1].lower()
    out = args.out or f"bench/results/caching-{device}.json"
    with open(out, "w") as f:
        json.dump({"device": device, "compile": args.compile, "models": results}, f, indent=1)
    print(json.dumps({"out": out}))


if __name__ == "__main__":
    main()
