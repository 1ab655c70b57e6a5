"""The step cache's quality guard on the trained tiny-video (a Wan DiT): paired seeded prompts
with and without caching, across thresholds.

    python bench/cache_quality.py                                 # >= 500 clips: a GPU's sweep
    python bench/cache_quality.py --prompts 24 --device cpu       # a CPU sample

One diffusion stage in this process with `--cache first-block`. Each prompt is a seeded clip of
the shapes world (a shape, its colour, the background, a direction); each runs uncached (a
threshold of 0: the uncached video bit for bit, tests/stages/diffusion/test_block_cache.py)
and at each threshold, with the same seed, in batches through our own loop. Per threshold and
decision: the share of block evaluations saved, the shapes checker's accuracy (the middle
frame's colour, background and shape, the clip's motion) and the PSNR of each video against
its uncached one (the checker is blind to blur). The default is the largest threshold whose
every accuracy stays within 1 point of the uncached and whose median PSNR is >= 30 dB.
Writes bench/results/cache_quality-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vllm_omni_like.config import StageConfig
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.pipelines.catalog import TINY_OPTIONS
from vllm_omni_like.shapes import checker, world
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.wire import StageRequest

ACCURACY_POINTS, MIN_PSNR = 0.01, 30.0


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 99.0 if mse == 0 else 10 * float(np.log10(255.0**2 / mse))


def clips(n: int, seed: int) -> list[world.Clip]:
    rng = random.Random(seed)
    return [world.sample_clip(rng) for _ in range(n)]


def read(clip: world.Clip, frames: np.ndarray) -> dict[str, bool]:
    """The checker's verdict on each attribute of a clip."""
    middle = checker.read_image(frames[len(frames) // 2])
    return {
        "colour": middle["colour"] == clip.colour,
        "background": middle["background"] == clip.background,
        "shape": middle["shape"] == clip.shape,
        "motion": checker.motion(frames) == clip.direction,
    }


def generate(stage, todo: list[world.Clip], args, threshold: float) -> list[np.ndarray]:
    control = StageControl(FaultInjector((), "diffusion"))
    videos = []
    for start in range(0, len(todo), args.batch):
        batch = [
            StageRequest(
                f"c{start + i}",
                clip.caption(),
                GenerationParams(
                    seed=start + i,
                    num_inference_steps=args.steps,
                    num_frames=args.frames,
                    cache_threshold=threshold,
                ),
                mode="text2video",
            )
            for i, clip in enumerate(todo[start : start + args.batch])
        ]
        outs = stage.execute(batch, control)
        for out in outs:
            assert out.error is None, out.error
            videos.append(out.video.frames)
    return videos


def sweep(stage, todo, args, decision: str, base: list[np.ndarray]) -> list[dict]:
    cache = stage.runtime.denoise.cache
    cache.lagged = decision == "lagged"
    rows = []
    for threshold in args.thresholds:
        cache.evaluations = cache.saved = 0
        began = time.perf_counter()
        videos = generate(stage, todo, args, threshold)
        seconds = time.perf_counter() - began
        verdicts = [read(c, v) for c, v in zip(todo, videos, strict=True)]
        psnrs = [psnr(v, b) for v, b in zip(videos, base, strict=True)]
        row = {
            "decision": decision,
            "threshold": threshold,
            "block_evals_saved": round(cache.saved_share, 4),
            "accuracy": {k: float(np.mean([v[k] for v in verdicts])) for k in verdicts[0]},
            "psnr_median": round(statistics.median(psnrs), 2),
            "psnr_p10": round(float(np.percentile(psnrs, 10)), 2),
            "seconds": round(seconds, 1),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def pick_default(rows: list[dict], uncached: dict[str, float]) -> dict | None:
    """The largest threshold of each decision within the guard (None: none is)."""
    ok = [
        r
        for r in rows
        if r["psnr_median"] >= MIN_PSNR
        and all(r["accuracy"][k] >= uncached[k] - ACCURACY_POINTS for k in uncached)
    ]
    return max(ok, key=lambda r: (r["threshold"], r["block_evals_saved"]), default=None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=500)
    ap.add_argument("--thresholds", default="0.02,0.05,0.1,0.15,0.2,0.3")
    ap.add_argument("--decisions", default="sync,lagged")
    ap.add_argument("--steps", type=int, default=20)  # (tiny-video's default)
    ap.add_argument("--frames", type=int, default=9)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.thresholds = [float(t) for t in args.thresholds.split(",")]
    stage = DiffusionStage(
        StageConfig(
            name="diffusion",
            kind="diffusion",
            model="tiny-video",
            device=args.device,
            max_batch_size=args.batch,
            cache="first-block",
            options=TINY_OPTIONS["tiny-video"],
        )
    )
    stage.load(args.device)
    device = stage.runtime.device.type
    todo = clips(args.prompts, args.seed)
    began = time.perf_counter()
    base = generate(stage, todo, args, 0.0)
    uncached_seconds = time.perf_counter() - began
    verdicts = [read(c, v) for c, v in zip(todo, base, strict=True)]
    uncached = {k: float(np.mean([v[k] for v in verdicts])) for k in verdicts[0]}
    print(json.dumps({"uncached": uncached, "seconds": round(uncached_seconds, 1)}), flush=True)
    rows = [r for d in args.decisions.split(",") for r in sweep(stage, todo, args, d, base)]
    chosen = {
        d: pick_default([r for r in rows if r["decision"] == d], uncached)
        for d in args.decisions.split(",")
    }
    result = {
        "model": "tiny-video",
        "device": device,
        "prompts": args.prompts,
        "steps": args.steps,
        "frames": args.frames,
        "uncached_accuracy": uncached,
        "uncached_seconds": round(uncached_seconds, 1),
        "sweep": rows,
        "default": chosen,
        "guard": f"accuracies within {ACCURACY_POINTS:.0%} of uncached, median PSNR >= {MIN_PSNR}",
    }
    out = args.out or f"bench/results/cache_quality-{device}.json"
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({"default": chosen, "out": out}))


if __name__ == "__main__":
    main()
