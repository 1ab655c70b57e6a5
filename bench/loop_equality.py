"""Our own denoising loop against the diffusers pipeline's own call, on a GPU (random weights).

    python bench/loop_equality.py --model sd15 --dtype fp16 --schedulers all
    python bench/loop_equality.py --model wan2.1-t2v-1.3b --dtype bf16 --frames 33
    python bench/loop_equality.py --model qwen-image --dtype bf16 --edit inpaint

One diffusion stage in this process (the shipped architecture, `--load-format dummy`). For each
scheduler the family runs: a request through our loop, and the same request through the
pipeline's own `__call__` (the stage's other path, the same scheduler built the same way): the
PSNR of the outputs. Then batch invariance: a mixed batch (other step counts, guidance scales
with and without CFG, schedulers and seeds) through our loop, and each of its requests alone:
the PSNR of each request's output in the batch against alone. For scale, the same for the
pipeline's own call: a request batched with another of the same settings against alone (how
much a batch's other shapes of matmul move diffusers' own result). Prints one JSON line per
figure and appends them to --out. `--no-batched-cfg`: our loop runs the two guidance branches
in two forwards, as the Wan pipeline calls them. `--edit img2img|inpaint`: every request an
edit of a synthetic upload at strength 0.6 (inpaint: a mask over its middle), against the
family's img2img or inpainting pipeline.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vllm_omni_like.config import StageConfig
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.pipelines.catalog import ARCH_OPTIONS, arch_path
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.wire import StageRequest


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def pixels(out) -> np.ndarray:
    assert out.error is None, out.error
    return out.video.frames if out.video is not None else np.stack([i.pixels for i in out.images])


def run(stage: DiffusionStage, batch: list[StageRequest], own: bool) -> dict[str, np.ndarray]:
    modes = stage.runtime.own
    stage.runtime.own = modes if own else set()
    try:
        outs = stage.begin(batch, StageControl(FaultInjector((), "diffusion"))).finish(batch)
    finally:
        stage.runtime.own = modes
    return {o.request_id: pixels(o) for o in outs}


def edit_inputs(edit: str | None, width: int, height: int) -> tuple[np.ndarray | None, ...]:
    """`--edit`'s upload (a colour gradient at the output's size) and, inpainting, its mask (the
    middle half repainted); (None, None) without it."""
    if edit is None:
        return None, None
    ys, xs = np.mgrid[0:height, 0:width]
    upload = np.stack([xs * 255 // width, ys * 255 // height, (xs + ys) % 256], -1)
    if edit == "img2img":
        return upload.astype(np.uint8), None
    mask = np.zeros((height, width), np.uint8)
    mask[height // 4 : 3 * height // 4, width // 4 : 3 * width // 4] = 255
    return upload.astype(np.uint8), mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="sd15")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--schedulers", default="all", help="comma-separated names, or all")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--frames", type=int, default=33)
    ap.add_argument("--size", default=None, help="WxH (default: the architecture's)")
    ap.add_argument("--no-batched-cfg", action="store_true")
    ap.add_argument("--edit", choices=("img2img", "inpaint"), default=None)
    ap.add_argument("--out", default="bench/results/loop_equality.jsonl")
    args = ap.parse_args()
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    options = dict(ARCH_OPTIONS.get(args.model, {}))
    config = StageConfig(
        name="diffusion",
        kind="diffusion",
        model=arch_path(args.model) if args.model in ARCH_OPTIONS else args.model,
        load_format="dummy",
        dtype=args.dtype,
        batched_cfg=not args.no_batched_cfg,
        options=options,
    )
    stage = DiffusionStage(config)
    stage.load("cuda:0" if torch.cuda.is_available() else "cpu")
    rt = stage.runtime
    video = rt.is_video
    width, height = (
        (int(s) for s in args.size.split("x"))
        if args.size
        else (rt.defaults.width, rt.defaults.height)
    )
    names = rt.family.schedulers if args.schedulers == "all" else args.schedulers.split(",")

    upload, mask = edit_inputs(args.edit, width, height)

    def request(rid: str, **params) -> StageRequest:
        params = {"width": width, "height": height, "num_inference_steps": args.steps, **params}
        if video:
            params["num_frames"] = args.frames
        prompt = f"a photo of a cat, {rid}"
        if upload is not None:
            p = GenerationParams(strength=0.6, **params)
            return StageRequest(rid, prompt, p, mode="edit", images=[upload], mask=mask)
        mode = "text2video" if video else "text2img"
        return StageRequest(rid, prompt, GenerationParams(**params), mode)

    lines = []

    def emit(**fields) -> None:
        line = {"model": args.model, "dtype": args.dtype, "device": device, **fields}
        line["batched_cfg"] = not args.no_batched_cfg
        if args.edit:
            line["edit"] = args.edit
        print(json.dumps(line), flush=True)
        lines.append(line)

    for name in [None, *names]:
        req = request("eq", seed=11, scheduler=name)
        started = time.perf_counter()
        ours = run(stage, [req], own=True)["eq"]
        theirs = run(stage, [req], own=False)["eq"]
        emit(
            figure="own loop vs the pipeline's call",
            scheduler=name or "the model's own",
            psnr_db=round(psnr(ours, theirs), 2),
            max_level_diff=int(np.abs(ours.astype(int) - theirs.astype(int)).max()),
            seconds=round(time.perf_counter() - started, 2),
        )
    kinds = stage.runtime.family.schedulers
    batch = [
        request("a", seed=1),
        request("b", seed=2, num_inference_steps=args.steps + 5, guidance_scale=1.0),
        request("c", seed=3, num_inference_steps=args.steps - 4, scheduler=kinds[-1]),
        request(
            "d",
            seed=4,
            guidance_scale=3.0,
            negative_prompt="blurry",
            scheduler=kinds[0],
            **({} if video else {"n": 2}),
        ),
    ]
    together = run(stage, batch, own=True)
    for r in batch:
        alone = run(stage, [r], own=True)[r.request_id]
        mine = together[r.request_id]
        emit(
            figure="batch invariance: in a mixed batch vs alone",
            request=r.request_id,
            scheduler=r.params.scheduler or "the model's own",
            steps=r.params.num_inference_steps,
            guidance=r.params.guidance_scale,
            psnr_db=round(psnr(mine, alone), 2),
            max_level_diff=int(np.abs(mine.astype(int) - alone.astype(int)).max()),
        )
    pair = [request("p", seed=5), request("q", seed=6)]
    both, alone = run(stage, pair, own=False)["p"], run(stage, pair[:1], own=False)["p"]
    emit(
        figure="for scale: the pipeline's own call, batched with another vs alone",
        psnr_db=round(psnr(both, alone), 2),
        max_level_diff=int(np.abs(both.astype(int) - alone.astype(int)).max()),
    )
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "a") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    stage.close()


if __name__ == "__main__":
    main()
