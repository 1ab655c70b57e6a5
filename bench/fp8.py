"""FP8 matmuls against bf16 on one GPU: our server's step, warm-up and memory, and plain
diffusers with torchao's FP8 in the same run (#56).

    python bench/fp8.py --model flux.1-dev                        # every part, one GPU call
    python bench/fp8.py --model flux.1-dev --parts bf16,fp8       # some parts (a call each)
    python bench/fp8.py --model /tmp/tiny-flux --dtype fp32 --steps 3 --runs 2 --size 64 \\
        --compile-backend eager                                    # the CPU smoke run

Each part runs in a process of its own (its warm-up from a cold start, its memory given back),
on the architecture's seeded random weights (`--load-format dummy`'s recipe: every part computes
the same model), at the model's published size and guidance (`SETTINGS`; `--steps` sets how many
steps are timed: a step takes what it takes at any count):
- `reference`: plain diffusers. Each linear layer the family's rule quantizes is measured on its
  own inputs in one eager bf16 call (its FP8 output's SQNR, the lowest over the calls:
  `min_layer_sqnr_db`); then torchao's `Float8DynamicActivationFloat8WeightConfig(
  granularity=PerRow())` on the transformer (every linear layer it takes, as the issue's anchor)
  with fused QKV and `torch.compile(fullgraph=True, dynamic=False)`: `reference_fp8_step_ms`.
  torchao refuses the CPU: there it is null, with torchao's reason.
- `reference-bf16`: the same pipeline compiled in bf16 (`reference_bf16_step_ms`).
- `bf16`, `fp8`: our stage as a worker loads it (`vllm-omni-like serve <model> --load-format
  dummy --compile` at the default flags: its batch buckets, its size; `--quantization fp8` for
  the second, compiled regionally), in this process: `warmup_s_*` (the whole load: weights,
  quantization, compile and warm-up of every bucket), `transformer_gib_*` (its parameters and
  buffers), the median step of one request on the device (the stage's timeline), its image.
  `fp8` also gives `psnr_fp8_vs_bf16_db` against the `bf16` part's image (same seed).
- `fp8-attention`: `fp8` with `--attention fp8` too (our Triton kernel, Q, K, P and V in FP8:
  stages/diffusion/fp8_attention.py): `fp8_attention_step_ms`, `fp8_attention_over_bf16` (the
  goal: <= 0.65), `psnr_fp8_attention_vs_bf16_db` against the `bf16` part's image.
- `fp8-restart`: `fp8` again over the compile cache the `fp8` part left on the disk
  (`warmup_s_fp8_restart`; the goal: within 1.3x of bf16's cold warm-up).
Each compiled part starts from an empty compile cache of its own (`--cache-dir`, one a
precision: bf16's VAE graphs would otherwise shorten fp8's warm-up).

Writes `bench/results/fp8-<device>.json`: `models.<name>` with the keys of #56 - bf16_step_ms,
fp8_step_ms, fp8_over_bf16, fp8_attention_step_ms, reference_fp8_step_ms, warmup_s_bf16,
warmup_s_fp8, min_layer_sqnr_db, transformer_gib_bf16, transformer_gib_fp8 - and a few beside
them; a part's figures are merged in as it ends. The attention kernel alone against bf16 SDPA:
bench/fp8_attention.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import itertools

from bench.cli_flags import add_dtype, add_model, add_outputs, parser
from bench.compare import db, psnr
from bench.raw_diffusers import DTYPES, PROMPT, free, merge_result
from bench.step_profile import step_timeline
from vllm_omni_like.models.registry import family_of
from vllm_omni_like.pipelines.catalog import ARCH_OPTIONS, arch_path

# the models at their published size and guidance; steps: those timed (any count runs
# the same steps); frames: a video's
SETTINGS: dict[str, dict[str, Any]] = {
    "flux.1-dev": {"steps": 28, "guidance": 3.5, "width": 1024, "height": 1024},
    "sd3.5-large": {"steps": 28, "guidance": 3.5, "width": 1024, "height": 1024},
    "qwen-image": {"steps": 20, "guidance": 4.0, "width": 1024, "height": 1024},
    "z-image-turbo": {"steps": 8, "guidance": 0.0, "width": 1024, "height": 1024},
    "wan2.2-ti2v-5b": {"steps": 6, "guidance": 5.0, "width": 1280, "height": 704, "frames": 121},
}
PARTS = ("reference", "reference-bf16", "bf16", "fp8", "fp8-attention", "fp8-restart")


def settings(args: argparse.Namespace) -> dict[str, Any]:
    s = dict(SETTINGS.get(args.model, {"steps": 3, "guidance": 3.5, "width": 64, "height": 64}))
    if args.size:
        s["width"] = s["height"] = args.size
    for key in ("steps", "guidance", "frames"):
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    return s


def path_of(model: str) -> str:
    return arch_path(model) if model in ARCH_OPTIONS else model


# ---- plain diffusers ----------------------------------------------------------------------------
def reference_call(pipe: Any, s: dict[str, Any], kwargs: dict[str, Any], steps: int) -> list:
    """One call of the pipeline as the server asks it; the device's step times (ms)."""
    marks: list[Any] = []
    cuda = pipe.device.type == "cuda"

    def on_step_end(pipe: Any, i: int, t: Any, kw: dict[str, Any]) -> dict[str, Any]:
        marks.append(torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter())
        if cuda:
            marks[-1].record()
        return kw

    video = {"num_frames": s["frames"]} if "frames" in s else {}
    pipe(
        generator=[torch.Generator(device=pipe.device).manual_seed(0)],
        num_inference_steps=steps,
        width=s["width"],
        height=s["height"],
        output_type="latent",
        callback_on_step_end=on_step_end,
        **video,
        **{k: list(v) if isinstance(v, list) else v for k, v in kwargs.items()},
    )
    if cuda:
        marks[-1].synchronize()
        return [a.elapsed_time(b) for a, b in itertools.pairwise(marks)]
    return [1000 * (b - a) for a, b in itertools.pairwise(marks)]


def reference_step_ms(pipe: Any, s: dict[str, Any], kwargs: dict[str, Any], runs: int) -> float:
    reference_call(pipe, s, kwargs, 2)  # compiles
    steps = [ms for _ in range(runs) for ms in reference_call(pipe, s, kwargs, s["steps"])]
    return round(statistics.median(steps), 2)


def part_reference(args: argparse.Namespace, s: dict[str, Any], fp8: bool) -> dict[str, Any]:
    from bench.models import build, call_kwargs
    from vllm_omni_like.models.adapter import adapter_for
    from vllm_omni_like.stages.diffusion.quantize import hooks_sqnr

    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = path_of(args.model)
    pipe = build(path, DTYPES[args.dtype], device)
    kwargs = call_kwargs(pipe, s["guidance"])
    if device == "cuda" and hasattr(pipe.transformer, "fuse_qkv_projections"):
        pipe.transformer.fuse_qkv_projections()  # (the server's, on CUDA)
    result: dict[str, Any] = {}
    if fp8:
        rule = adapter_for(pipe, family_of(path)).high_precision_layers()
        found, remove = hooks_sqnr(pipe.transformer, rule)
        with torch.inference_mode():
            reference_call(pipe, s, kwargs, 2)
        remove()
        lowest = min(found, key=found.__getitem__)
        result["min_layer_sqnr_db"] = round(found[lowest], 2)
        result["min_layer_sqnr_layer"], result["sqnr_layers"] = lowest, len(found)
        result.update(torchao_fp8(pipe))
        if "reference_fp8_reason" in result:
            return result
    options: dict[str, Any] = {"fullgraph": True, "dynamic": False}
    if args.compile_backend != "inductor":
        options["backend"] = args.compile_backend
    pipe.transformer = torch.compile(pipe.transformer, **options)
    key = "reference_fp8_step_ms" if fp8 else "reference_bf16_step_ms"
    with torch.inference_mode():
        result[key] = reference_step_ms(pipe, s, kwargs, args.runs)
    del pipe
    free()
    return result


def torchao_fp8(pipe: Any) -> dict[str, Any]:
    """torchao's rowwise dynamic FP8 on the transformer, as the issue's anchor ran it."""
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_

    try:
        config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
        quantize_(pipe.transformer, config)
    except AssertionError as exc:  # its hardware check: CUDA >= 8.9, MI300 or XPU only
        return {"reference_fp8_step_ms": None, "reference_fp8_reason": f"torchao: {exc}"}
    import torchao

    return {"torchao": torchao.__version__}


# ---- our stage ----------------------------------------------------------------------------------
def stage_config(
    args: argparse.Namespace, s: dict[str, Any], quantization: str, attention: str = "sdpa"
) -> Any:
    """The diffusion stage `serve <model> --load-format dummy --compile` builds, at the
    default flags but the precision (and the size: the model's own)."""
    import dataclasses

    from vllm_omni_like.pipelines.catalog import resolve

    kw: dict[str, Any] = {"load_format": "dummy", "dtype": args.dtype, "compile": True}
    kw |= {"quantization": quantization, "warmup_sizes": (f"{s['width']}x{s['height']}",)}
    kw["attention"] = attention
    if args.batch_buckets:
        kw["batch_buckets"] = tuple(int(b) for b in args.batch_buckets.split(","))
    config = resolve(args.model, **kw)[0].stages[-1]
    limits = {"max_side": max(s["width"], s["height"], 64), "max_frames": s.get("frames")}
    options = dataclasses.replace(config.options, compile_backend=args.compile_backend)
    return dataclasses.replace(config, options=options, **{k: v for k, v in limits.items() if v})


def part_stage(
    args: argparse.Namespace, s: dict[str, Any], quantization: str, attention: str = "sdpa"
) -> dict[str, Any]:
    from vllm_omni_like.params import GenerationParams
    from vllm_omni_like.stages.base import StageControl, create_stage
    from vllm_omni_like.stages.diffusion.quantize import model_bytes
    from vllm_omni_like.stages.faults import FaultInjector
    from vllm_omni_like.stages.trace import TRACE_BATCHES_ENV, TRACE_DIR_ENV
    from vllm_omni_like.wire import StageRequest

    timeline = tempfile.mkdtemp(prefix="fp8-timeline-")
    os.environ[TRACE_DIR_ENV], os.environ[TRACE_BATCHES_ENV] = timeline, ""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    stage = create_stage(stage_config(args, s, quantization, attention))
    stage.load(device)
    warmup_s = time.perf_counter() - t0
    rt = stage.runtime
    held = sum(model_bytes(e.model) for e in rt.adapter.experts())
    video = "frames" in s
    params = GenerationParams(
        seed=0,
        num_inference_steps=s["steps"],
        guidance_scale=s["guidance"],
        width=s["width"],
        height=s["height"],
        num_frames=s.get("frames"),
    )
    request = StageRequest("r", PROMPT, params, mode="text2video" if video else "text2img")
    control = StageControl(FaultInjector((), "diffusion"))
    stage.execute([request], control)  # (a first request: nothing of the warm-up's left)
    since = time.monotonic()
    for _ in range(args.runs):
        (out,) = stage.execute([request], control)
    media = out.video.frames if video else out.images[0].pixels
    steps = step_timeline(timeline, s["steps"], since)["step_ms_by_rows"]
    name = {"fp8": "fp8", "none": "bf16"}[quantization]
    name += "_attention" if attention == "fp8" else ""
    result = {
        f"{name}_step_ms": steps.get(1),
        f"transformer_gib_{name}": round(held / 2**30, 3),
        f"transformer_bytes_{name}": held,
        f"precision_{name}": stage.precision(),
    }
    if torch.cuda.is_available():
        result[f"gpu_memory_gib_{name}"] = round(torch.cuda.memory_allocated() / 2**30, 3)
    result[f"warmup_s_{name}"] = round(warmup_s, 1)
    images = os.path.join(args.cache_dir, "images.npz")
    if name == "bf16":
        np.savez(images, bf16=media)
    elif os.path.exists(images):
        result[f"psnr_{name}_vs_bf16_db"] = db(psnr(media, np.load(images)["bf16"]))
    return result


# ---- the run ------------------------------------------------------------------------------------
def run_part(args: argparse.Namespace, part: str) -> dict[str, Any]:
    """`part` in a process of its own, over its precision's compile cache."""
    cache = os.path.join(args.cache_dir, "inductor-" + ("fp8" if part == "fp8-restart" else part))
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    argv = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", part]
    argv += ["--cache-dir", args.cache_dir]
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    sys.stderr.write(done.stderr[-4000:])
    if done.returncode != 0:
        return {f"{part}_error": done.stderr.strip().splitlines()[-1][-500:]}
    found: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if part == "fp8-restart":
        found = {"warmup_s_fp8_restart": found["warmup_s_fp8"]}
    return found


def child(args: argparse.Namespace, part: str) -> dict[str, Any]:
    from vllm_omni_like.executor.placement import share_compile_cache

    share_compile_cache()  # (the server's settings; the parent chose the directory)
    s = settings(args)
    if part.startswith("reference"):
        return part_reference(args, s, fp8=part == "reference")
    attention = "fp8" if part == "fp8-attention" else "sdpa"
    return part_stage(args, s, "fp8" if part.startswith("fp8") else "none", attention)


def write(name: str, entry: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """Merge `entry` into `models.<name>` of fp8-<device>.json, the ratios once both sides
    are in."""
    with merge_result("fp8", name, entry, out_dir) as merged:
        for name in ("fp8", "fp8_attention"):
            if merged.get("bf16_step_ms") and merged.get(f"{name}_step_ms"):
                ratio = merged[f"{name}_step_ms"] / merged["bf16_step_ms"]
                merged[f"{name}_over_bf16"] = round(ratio, 4)
        ref_bf16 = merged.get("reference_bf16_step_ms")
        ref_fp8 = merged.get("reference_fp8_step_ms")
        if ref_bf16 and ref_fp8:
            merged["reference_fp8_over_bf16"] = round(ref_fp8 / ref_bf16, 4)
    return merged


def main() -> int:
    ap = parser(__doc__)
    add_model(ap, "flux.1-dev", "reference,bf16,fp8,fp8-attention,fp8-restart")
    add_dtype(ap, DTYPES, "bf16")
    ap.add_argument("--steps", type=int, help="steps timed a request (default: SETTINGS)")
    ap.add_argument("--guidance", type=float)
    ap.add_argument("--size", type=int, help="width and height (default: the model's)")
    ap.add_argument("--frames", type=int)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--batch-buckets", help="the stage's buckets (default: the server's)")
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--cache-dir", help="where the parts' compile caches go (default: a new one)")
    add_outputs(ap)
    ap.add_argument("--child", choices=PARTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:  # one part, in this process: its figures as the last line
        print(json.dumps(child(args, args.child)), flush=True)
        return 0
    args.cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="fp8-bench-")
    s = settings(args)
    name = os.path.basename(os.path.normpath(args.model))
    entry: dict[str, Any] = {**s, "dtype": args.dtype, "compile_backend": args.compile_backend}
    for part in args.parts.split(","):
        if part not in PARTS:
            ap.error(f"--parts: {part!r} is none of {', '.join(PARTS)}")
        t0 = time.perf_counter()
        entry.update(run_part(args, part))
        print(f"{part}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        print(json.dumps(write(name, entry, args.out_dir)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
