"""Plain diffusers: the reference every GPU figure is compared with (docs/benchmarks.md).

    python bench/raw_diffusers.py images --batch-sizes 1,2,4,8,16,32 --compile both
    python bench/raw_diffusers.py video

What a user would write instead of serving: `DiffusionPipeline(...)(prompt=...)`, then the bytes
a user gets (PNG at the server's default compression level; H.264 MP4 for videos). Random
weights (`--load-format dummy`'s seeded recipe, so the server computes the same images), the
same dtype, resolution, scheduler, steps, guidance and seeds as the server; no safety checker.
`bench/serving.py` imports these functions to run the reference in the same run as the server.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch
from PIL import Image

from vllm_omni_like.media import PNG_COMPRESS_LEVEL
from vllm_omni_like.pipelines.catalog import ARCH_OPTIONS, arch_path
from vllm_omni_like.stages.diffusion.prompt_embeds import random_prompt_embeds
from vllm_omni_like.stages.torch_utils import dummy_pipeline
from vllm_omni_like.video_codec import encode_video

PROMPT = "a red circle at the top left on a blue background"
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def gpu_name() -> str:
    """The CUDA device's full name ('NVIDIA H200'); 'cpu' without one."""
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def merge_result(prefix: str, name: str, entry: dict[str, Any], out_dir: str) -> Any:
    """`<out_dir>/<prefix>-<device>.json`'s `models.<name>` updated with `entry`: a context
    manager giving the merged entry to complete (ratios once both parts are in), written back
    as the block ends."""
    return _Merged(os.path.join(out_dir, f"{prefix}-{device_name()}.json"), name, entry)


class _Merged:
    def __init__(self, path: str, name: str, entry: dict[str, Any]) -> None:
        self.path, self.name, self.entry = path, name, entry
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        self.data: dict[str, Any] = {"device": gpu, "torch": torch.__version__, "models": {}}

    def __enter__(self) -> dict[str, Any]:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        if os.path.exists(self.path):
            with open(self.path) as f:
                self.data = json.load(f)
        self.merged: dict[str, Any] = {**self.data["models"].get(self.name, {}), **self.entry}
        return self.merged

    def __exit__(self, *failure: Any) -> None:
        if failure[0] is None:
            self.data["models"][self.name] = self.merged
            with open(self.path, "w") as f:
                json.dump(self.data, f, indent=1)


def device_name() -> str:
    """'h100', 'h200', ... from the CUDA device name; 'cpu' without one."""
    if not torch.cuda.is_available():
        return "cpu"
    name = gpu_name().lower()
    for word in name.replace("-", " ").split():
        if word[:1] in "abhl" and word[1:].isdigit():
            return word
    return name.split()[-1]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def build(arch: str, dtype: str, device: str, compile_unet: bool = False) -> Any:
    """The pipeline with the same seeded random weights as the server's `--load-format dummy`."""
    import diffusers

    diffusers.utils.logging.disable_progress_bar()
    pipe = dummy_pipeline(arch_path(arch), torch.device(device), DTYPES[dtype]).to(device)
    pipe.set_progress_bar_config(disable=True)
    if compile_unet:  # what diffusers' docs tell a user to do; static shapes, one graph a batch
        pipe.unet = torch.compile(pipe.unet, dynamic=False)  # size, as the server's buckets
    return pipe


def png(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buf.getvalue()


def images(
    pipe: Any, seeds: list[int], steps: int, size: int, guidance: float
) -> tuple[np.ndarray, list[bytes], float]:
    """One plain-diffusers call for len(seeds) images, then their PNGs; (pixels, pngs, seconds)."""
    device = pipe.device
    sync()
    t0 = time.perf_counter()
    out = pipe(
        prompt=[PROMPT] * len(seeds),
        negative_prompt=[""] * len(seeds),
        generator=[torch.Generator(device=device).manual_seed(s) for s in seeds],
        num_inference_steps=steps,
        guidance_scale=guidance,
        height=size,
        width=size,
        output_type="np",
    ).images
    pixels = (out * 255).round().astype(np.uint8)  # diffusers' numpy_to_pil
    pngs = [png(p) for p in pixels]
    return pixels, pngs, time.perf_counter() - t0


def image_reference(
    pipe: Any, args: argparse.Namespace, batch_sizes: list[int], label: str
) -> dict[str, Any]:
    """Batch-1 latency (median) with its images, and throughput at each batch size."""
    images(pipe, [0], args.steps, args.size, args.guidance)  # warm-up (compiles, if compiled)
    lat, ref = [], {}
    for seed in range(args.latency_runs):
        pixels, _, seconds = images(pipe, [seed], args.steps, args.size, args.guidance)
        lat.append(seconds)
        ref[seed] = pixels[0]
    result: dict[str, Any] = {"bs1_latency_s": statistics.median(lat), "img_s": {}}
    for b in batch_sizes:
        seeds = list(range(1000, 1000 + b))
        images(pipe, seeds, args.steps, args.size, args.guidance)  # warm-up this shape
        t0 = time.perf_counter()
        for _ in range(args.runs):
            images(pipe, seeds, args.steps, args.size, args.guidance)
        result["img_s"][b] = round(b * args.runs / (time.perf_counter() - t0), 3)
        print(f"reference {label} batch {b}: {result['img_s'][b]} img/s", file=sys.stderr)
    result["images"] = ref
    return result


def video(pipe: Any, seed: int, opts: dict[str, Any], fps: int) -> tuple[np.ndarray, bytes, float]:
    """One plain-diffusers Wan video and its MP4; (uint8 frames, mp4 bytes, seconds)."""
    device = pipe.device
    dtype = pipe.transformer.dtype
    dim = pipe.transformer.config.text_dim
    seq = opts["max_sequence_length"]
    sync()
    t0 = time.perf_counter()
    frames = pipe(
        prompt_embeds=random_prompt_embeds([PROMPT], seq, dim, dtype, device),
        negative_prompt_embeds=random_prompt_embeds([""], seq, dim, dtype, device),
        num_frames=opts["default_frames"],
        height=opts["default_height"],
        width=opts["default_width"],
        num_inference_steps=opts["default_steps"],
        guidance_scale=opts["default_guidance"],
        generator=torch.Generator(device=device).manual_seed(seed),
        output_type="np",
    ).frames[0]
    pixels = (frames * 255).round().astype(np.uint8)
    mp4 = encode_video(pixels, fps)
    return pixels, mp4, time.perf_counter() - t0


def video_reference(
    dtype: str, runs: int, fps: int, opts: dict[str, Any] | None = None
) -> dict[str, Any]:
    arch = "wan2.1-t2v-1.3b"
    pipe = build(arch, dtype, "cuda" if torch.cuda.is_available() else "cpu")
    opts = opts or ARCH_OPTIONS[arch]
    first = video(pipe, 0, opts, fps)[0]  # warm-up
    times, mp4 = [], b""
    for _ in range(runs):
        frames, mp4, seconds = video(pipe, 0, opts, fps)
        times.append(seconds)
    del pipe
    free()
    return {
        "seconds": statistics.median(times),
        "mp4": mp4,
        "frames": frames,
        "repeatable": bool(np.array_equal(first, frames)),  # same seed, same frames
        "settings": opts,
    }


def free() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The SD1.5 image workload every image benchmark runs, reference and servers alike."""
    ap.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--guidance", type=float, default=7.5)


def add_image_args(ap: argparse.ArgumentParser) -> None:
    add_workload_args(ap)
    ap.add_argument("--latency-runs", type=int, default=5)
    ap.add_argument("--runs", type=int, default=2, help="timed calls per batch size")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    im = sub.add_parser("images", help="SD1.5 architecture")
    add_image_args(im)
    im.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    im.add_argument("--compile", choices=("off", "on", "both"), default="both")
    vid = sub.add_parser("video", help="Wan2.1-T2V-1.3B architecture")
    vid.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    vid.add_argument("--runs", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report: dict[str, Any] = {"device": device_name()}
    if args.what == "images":
        sizes = [int(b) for b in args.batch_sizes.split(",")]
        for compiled in {"off": [False], "on": [True], "both": [False, True]}[args.compile]:
            label = "compile" if compiled else "eager"
            pipe = build("sd15", args.dtype, device, compile_unet=compiled)
            found = image_reference(pipe, args, sizes, label)
            found.pop("images")
            report[label] = found
            del pipe
            free()
    else:
        found = video_reference(args.dtype, args.runs, 16)
        report["video_s"] = found["seconds"]
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
