"""Where the GPU time of an SD1.5-architecture batch goes (docs/benchmarks.md, issue #6).

    python bench/profile_unet.py --batch 32 --out-dir bench/results      # on a GPU machine

For the server's batch shape (`--batch` images, CFG doubles the UNet batch, 512x512, fp16, the
seeded random weights of `--load-format dummy`) it measures:
- the UNet's compute per image (FLOPs counted by torch's FlopCounterMode, 30 steps with CFG) and
  the VAE decode's;
- for each kernel setting of `--variants` and each `--batch`: the time of one UNet forward and
  of one VAE decode, the img/s that 30 such forwards plus one decode allow, and the UNet's
  TFLOP/s. A setting is `+`-joined tokens: `plain` (what diffusers does by default), `cudnnb`
  (cuDNN autotuning), `cl` (channels_last), `qkv` (fused QKV projections), `flash` /
  `efficient` / `cudnn` (one SDPA backend forced), `compile` (torch.compile of the UNet, default
  mode) or `autotune` (mode max-autotune-no-cudagraphs), `vae` (the VAE decoder compiled too);
- for the `--profile` settings, a torch.profiler breakdown of one forward at the largest batch
  by kernel kind (convolution, GEMM, attention, normalisation, fused Triton, other) and the top
  kernels;
- the CPU time of one PNG at the server's compression level.
Writes profile-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from typing import Any

import raw_diffusers as ref
import torch
from cli_flags import add_dtype, add_outputs

from vllm_omni_like.models.stable_diffusion.adapter import StableDiffusionAdapter
from vllm_omni_like.stages.diffusion.acceleration import compile_models
from vllm_omni_like.stages.torch_utils import tensor_to_uint8

SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
}
DEFAULT_VARIANTS = (
    "plain,cudnnb,cudnnb+qkv,cudnnb+cl,cudnnb+cl+qkv,compile+cudnnb+qkv,compile+cudnnb+cl+qkv+vae"
)
PROFILED = "plain,cudnnb+cl+qkv,compile+cudnnb+qkv"
KINDS = (  # first match wins; kernel names of cuDNN, cuBLAS, CUTLASS, FlashAttention, Triton
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("convolution", ("conv", "fprop", "implicit", "dgrad", "winograd")),
    ("gemm", ("gemm", "nvjet", "cutlass", "cublas", "mm_")),
    ("normalisation", ("norm",)),
    ("fused triton", ("triton",)),
)


def kind_of(kernel: str) -> str:
    name = kernel.lower()
    return next((kind for kind, words in KINDS if any(w in name for w in words)), "other")


def inputs(pipe: Any, rows: int, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    unet = pipe.unet
    lat = size // pipe.vae_scale_factor
    gen = torch.Generator(device=pipe.device).manual_seed(0)
    sample = torch.randn(rows, unet.config.in_channels, lat, lat, generator=gen, device=pipe.device)
    text = torch.randn(rows, 77, unet.config.cross_attention_dim, generator=gen, device=pipe.device)
    t = torch.full((rows,), 500, device=pipe.device, dtype=torch.long)
    return sample.to(unet.dtype), t, text.to(unet.dtype)


def timed(fn: Any, repeats: int) -> float:
    for _ in range(2):
        fn()
    ref.sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    ref.sync()
    return (time.perf_counter() - t0) / repeats


def unet_call(pipe: Any, rows: int, size: int, backend: str | None) -> Any:
    sample, t, text = inputs(pipe, rows, size)

    def call() -> None:
        with torch.inference_mode():
            if backend is None:
                pipe.unet(sample, t, encoder_hidden_states=text, return_dict=False)
                return
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[backend])]):
                pipe.unet(sample, t, encoder_hidden_states=text, return_dict=False)

    return call


def flops(fn: Any) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        fn()
    return float(counter.get_total_flops())


def breakdown(fn: Any, top: int) -> dict[str, Any]:
    """GPU kernel time of one call by kind, and its top kernels."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    ref.sync()
    cuda = torch.cuda.is_available()
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        fn()
        ref.sync()
    by_kernel: dict[str, float] = defaultdict(float)
    for evt in prof.events():
        on_device = evt.device_type == torch.autograd.DeviceType.CUDA
        if on_device == cuda and (cuda or not evt.cpu_parent):
            by_kernel[evt.name] += evt.time_range.elapsed_us() / 1000.0
    total = sum(by_kernel.values()) or 1.0
    kinds: dict[str, float] = defaultdict(float)
    for name, ms in by_kernel.items():
        kinds[kind_of(name)] += ms
    ranked = sorted(by_kernel.items(), key=lambda kv: -kv[1])[:top]
    return {
        "kernel_ms": round(total, 2),
        "share_by_kind": {
            k: round(v / total, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])
        },
        "top_kernels": [
            {"name": n[:120], "ms": round(ms, 2), "kind": kind_of(n)} for n, ms in ranked
        ],
    }


def configure(pipe: Any, tokens: set[str], state: dict[str, Any]) -> None:
    """Put the pipeline in one kernel setting from scratch (see --variants)."""
    import torch._dynamo

    pipe.unet = getattr(pipe.unet, "_orig_mod", pipe.unet)
    pipe.vae.decoder = getattr(pipe.vae.decoder, "_orig_mod", pipe.vae.decoder)
    torch._dynamo.reset()
    torch.backends.cudnn.benchmark = "cudnnb" in tokens
    if ("qkv" in tokens) != state.get("fused", False):
        (pipe.fuse_qkv_projections if "qkv" in tokens else pipe.unfuse_qkv_projections)()
        state["fused"] = "qkv" in tokens
    layout = torch.channels_last if "cl" in tokens else torch.contiguous_format
    pipe.unet.to(memory_format=layout)
    pipe.vae.to(memory_format=layout)
    mode = (
        "default"
        if "compile" in tokens
        else "max-autotune-no-cudagraphs"
        if "autotune" in tokens
        else None
    )
    if mode:
        compile_models(StableDiffusionAdapter(pipe), mode, "inductor")  # the UNet, the VAE decoder
        if "vae" not in tokens:  # the UNet alone
            pipe.vae.decoder = pipe.vae.decoder._orig_mod


def measure(
    pipe: Any, tokens: set[str], batch: int, args: argparse.Namespace, flop: dict[str, float]
) -> dict[str, Any]:
    backend = next((b for b in SDPA_BACKENDS if b in tokens), None)
    t0 = time.perf_counter()
    call = unet_call(pipe, 2 * batch, args.size, backend)
    latents = inputs(pipe, batch, args.size)[0]

    def decode() -> None:
        with torch.inference_mode():
            pipe.vae.decode(latents / pipe.vae.config.scaling_factor)

    call()  # compiles, autotunes
    decode()
    warm = time.perf_counter() - t0
    forward_s = timed(call, args.repeats)
    decode_s = timed(decode, 2)
    batch_s = args.steps * forward_s + decode_s
    return {
        "unet_forward_ms": round(forward_s * 1000, 2),
        "vae_decode_ms": round(decode_s * 1000, 1),
        "gpu_img_s": round(batch / batch_s, 3),
        "unet_tflop_s": round(flop["unet_row"] * 2 * batch / forward_s / 1e12, 1),
        "first_call_s": round(warm, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--batch", default="1,32", help="images per batch (UNet rows: twice)")
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    add_dtype(ap, ref.DTYPES, "fp16")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated; see the top")
    ap.add_argument("--profile", default=PROFILED, help="variants whose kernels are broken down")
    ap.add_argument("--top", type=int, default=12)
    add_outputs(ap)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pipe = ref.build("sd15", args.dtype, device.type)
    with torch.inference_mode():
        flop = {
            "unet_row": flops(unet_call(pipe, 2, args.size, None)) / 2,
            "vae": flops(lambda: pipe.vae.decode(inputs(pipe, 1, args.size)[0])),
        }
        pixels = tensor_to_uint8(
            pipe.vae.decode(inputs(pipe, 1, args.size)[0]).sample.add(1).div(2)
        )[0]
    result: dict[str, Any] = {
        "device": ref.device_name(),
        "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "setting": {"size": args.size, "steps": args.steps, "dtype": args.dtype, "cfg": True},
        "unet_tflop_per_image": round(flop["unet_row"] * 2 * args.steps / 1e12, 2),
        "vae_decode_tflop_per_image": round(flop["vae"] / 1e12, 3),
        "png_ms_per_image": png_ms(pixels),
        "variants": {},
    }
    out_path = os.path.join(args.out_dir, f"profile-{result['device']}.json")
    os.makedirs(args.out_dir, exist_ok=True)
    state: dict[str, Any] = {}
    for name in args.variants.split(","):
        tokens = set(name.split("+"))
        entry: dict[str, Any] = {}
        try:
            configure(pipe, tokens, state)
            compiled = tokens & {"compile", "autotune"}
            for batch in batches[-1:] if compiled else batches:  # a compile per shape is slow
                entry[f"batch{batch}"] = measure(pipe, tokens, batch, args, flop)
            if name in args.profile.split(","):
                entry["profile"] = breakdown(
                    unet_call(pipe, 2 * batches[-1], args.size, None), args.top
                )
        except Exception as exc:  # a backend that cannot run this shape here
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        result["variants"][name] = entry
        print(
            f"{name}: {json.dumps({k: v for k, v in entry.items() if k != 'profile'})}",
            file=sys.stderr,
        )
        if "profile" in entry:
            print(json.dumps(entry["profile"], indent=1), file=sys.stderr)
        with open(out_path, "w") as f:  # variant by variant: a cut-off run keeps what it measured
            json.dump(result, f, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "variants"}, indent=1))
    print(f"wrote {out_path}", file=sys.stderr)


def png_ms(pixels: Any) -> float:
    """CPU time of one PNG as both sides encode it (the reference's `png`)."""
    t0 = time.perf_counter()
    for _ in range(5):
        ref.png(pixels)
    return round((time.perf_counter() - t0) / 5 * 1000, 1)


if __name__ == "__main__":
    main()
