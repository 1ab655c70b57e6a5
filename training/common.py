"""Shared by the training scripts: seeding, data rendering in parallel, logging, reports."""

from __future__ import annotations

import json
import os
import random
import sys
import time
from multiprocessing import Pool

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from vllm_omni_like.shapes import world


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _render_scene(args):
    seed, held_out = args
    rng = random.Random(seed)
    scene = world.sample_scene(rng, held_out)
    return world.render(scene), scene.caption(), world.short_prompt(scene, rng), scene


def _render_clip(seed):
    rng = random.Random(seed)
    clip = world.sample_clip(rng)
    return world.render_clip(clip), clip.caption(), clip


def scenes(n: int, seed: int, held_out: bool = False, workers: int = 0):
    """n rendered scenes: (images uint8 [n,64,64,3], captions, short prompts, scenes)."""
    jobs = [(seed * 1_000_003 + i, held_out) for i in range(n)]
    with Pool(workers or os.cpu_count()) as pool:
        rows = pool.map(_render_scene, jobs, chunksize=256)
    images, captions, shorts, found = zip(*rows, strict=True)
    return np.stack(images), list(captions), list(shorts), list(found)


def clips(n: int, seed: int, workers: int = 0):
    with Pool(workers or os.cpu_count()) as pool:
        rows = pool.map(_render_clip, [seed * 1_000_003 + i for i in range(n)], chunksize=64)
    frames, captions, found = zip(*rows, strict=True)
    return np.stack(frames), list(captions), list(found)


class Log:
    def __init__(self, every: int = 200) -> None:
        self.every, self.t0 = every, time.time()

    def __call__(self, step: int, **values: float) -> None:
        if step % self.every == 0:
            text = " ".join(f"{k}={v:.4f}" for k, v in values.items())
            print(f"[{time.time() - self.t0:7.1f}s] step {step} {text}", flush=True)


def write_report(path: str, report: dict) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2), flush=True)
