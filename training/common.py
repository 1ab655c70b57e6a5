"""Shared by the training scripts: seeding, data rendering in parallel, logging, reports."""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from collections.abc import Callable
from multiprocessing import Pool

import numpy as np
import torch
import torch.nn.functional as F

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


def _render_clip(job):
    seed, frames = job
    rng = random.Random(seed)
    clip = world.sample_clip(rng)
    return world.render_clip(clip, frames), clip.caption(), clip


def scenes(n: int, seed: int, held_out: bool = False, workers: int = 0):
    """n rendered scenes: (images uint8 [n,64,64,3], captions, short prompts, scenes)."""
    jobs = [(seed * 1_000_003 + i, held_out) for i in range(n)]
    with Pool(workers or os.cpu_count()) as pool:
        rows = pool.map(_render_scene, jobs, chunksize=256)
    images, captions, shorts, found = zip(*rows, strict=True)
    return np.stack(images), list(captions), list(shorts), list(found)


def clips(n: int, seed: int, workers: int = 0, frames: int = 9):
    """n rendered clips of `frames` frames: (uint8 [n,F,64,64,3], captions, clips)."""
    jobs = [(seed * 1_000_003 + i, frames) for i in range(n)]
    with Pool(workers or os.cpu_count()) as pool:
        rows = pool.map(_render_clip, jobs, chunksize=64)
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


def cosine(step: int, total: int, warmup: int = 200) -> float:
    """Learning-rate factor: linear warm-up, then cosine decay to zero at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def train_vae(
    vae,
    sample: Callable[[], torch.Tensor],
    steps: int,
    log: Log,
    deadline: float = math.inf,
    lr: float = 1e-3,
) -> None:
    """Reconstruction + a small KL term; `sample()` gives a batch in [-1, 1]; stops at deadline."""
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine(s, steps))
    vae.train()
    for step in range(steps):
        if time.monotonic() > deadline:  # a time budget: keep what was learned so far
            print(f"vae: time budget reached at step {step}", flush=True)
            break
        x = sample()
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=x.is_cuda):
            post = vae.encode(x).latent_dist
            rec = vae.decode(post.sample()).sample
        loss = F.mse_loss(rec.float(), x) + 1e-6 * post.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        log(step, vae_loss=loss.item())
    vae.eval()
