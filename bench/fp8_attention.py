"""The FP8 attention kernel (`--attention fp8`) against bf16 SDPA on one GPU, in the same run:
its time and its accuracy at a diffusion transformer's attention shape (#56).

    python bench/fp8_attention.py                          # FLUX.1-dev at 1024x1024
    python bench/fp8_attention.py --seq 4608 --heads 24 --dim 128 --batch 2 --runs 50
    python bench/fp8_attention.py --seq 4352 --batch 2 --real-text 100 --text 256  # Qwen-Image

The shape by default is FLUX.1-dev's at 1024x1024: 4096 image tokens and 512 text tokens in
one joint attention, 24 heads of 128. Timed with CUDA events, the median of `--runs` calls
after `--warmup` ones, each of:
- `sdpa_flash_ms`: `F.scaled_dot_product_attention` in bf16 on its flash kernel
  (`sdpa_kernel(FLASH_ATTENTION)`), in the (B, H, S, D) layout it is fastest in;
- `sdpa_cudnn_ms`: the same on cuDNN's kernel (the fastest on Hopper; null where absent);
- `fp8_ms`: our op (`torch.ops.vllm_omni_like.fp8_attention`: the quantization launch and
  the attention launch) on the processors' (B, S, H, D) layout, as the server calls it;
  `fp8_over_flash`, `fp8_over_cudnn` the ratios.
With `--real-text N` the keys are a text of `--text` tokens (first) of which the first N are
real, and a key-padding mask leaves out the rest (Qwen-Image's, Z-Image's padded texts): then
`sdpa_masked_ms` (SDPA with the boolean mask, on the kernel it picks) beside `fp8_ms` (ours
with the mask), `fp8_over_masked`.
Accuracy over the same inputs against float32 SDPA (random, and `--outliers`: keys with a
channel offset, an outlier token and value channel): `*_sqnr_db`, `*_cosine` of the kernel,
of bf16 SDPA, and the kernel against its torch emulation (`kernel_vs_emulation_sqnr_db`: the
same maths; only the float32 sums' order differs).

Writes `bench/results/fp8_attention-<device>.json` (`models.<shape>`, a key per shape).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.masked_attention import clock
from bench.raw_diffusers import merge_result
from vllm_omni_like.stages.diffusion.fp8 import sqnr_db
from vllm_omni_like.stages.diffusion.fp8_attention import emulate, fp8_attention

DEVICE = "cuda"  # (a dry run of this script's code on the CPU sets "cpu")


def median_ms(fn: Callable[[], Any], warmup: int, runs: int) -> float:
    """Median milliseconds of `fn` on the GPU (masked_attention.py's clock)."""
    return round(clock(fn, runs, torch.device("cuda"), warmup), 4)


def inputs(args: argparse.Namespace) -> list[torch.Tensor]:
    """q, k, v in the processors' (B, S, H, D) layout, bf16."""
    g = torch.Generator(device=DEVICE).manual_seed(0)
    shape = (args.batch, args.seq, args.heads, args.dim)
    q, k, v = (torch.randn(shape, device=DEVICE, generator=g) for _ in range(3))
    if args.outliers:
        k[..., :4] += 20.0
        q[:, 7] *= 30.0
        v[..., 5] *= 50.0
    return [x.bfloat16() for x in (q, k, v)]


def accuracy(name: str, got: torch.Tensor, want: torch.Tensor) -> dict[str, float]:
    cosine = F.cosine_similarity(got.double().flatten(), want.double().flatten(), dim=0)
    return {f"{name}_sqnr_db": round(sqnr_db(want, got), 2), f"{name}_cosine": cosine.item()}


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)


def key_padding(args: argparse.Namespace) -> torch.Tensor | None:
    """With `--real-text`: the keys kept (B, S), a padded text's first."""
    if args.real_text is None:
        return None
    keep = torch.ones(args.batch, args.seq, dtype=torch.bool, device=DEVICE)
    keep[:, args.real_text : args.text] = False
    return keep


def measure(args: argparse.Namespace) -> dict[str, Any]:
    q, k, v = inputs(args)
    scale = args.dim**-0.5
    heads_first = [x.transpose(1, 2).contiguous() for x in (q, k, v)]
    found: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    keep = key_padding(args)
    if keep is not None:
        return found | measure_masked(args, q, k, v, keep)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        found["sdpa_flash_ms"] = median_ms(lambda: sdpa(*heads_first), args.warmup, args.runs)
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            found["sdpa_cudnn_ms"] = median_ms(lambda: sdpa(*heads_first), args.warmup, args.runs)
    except RuntimeError as exc:  # no cuDNN attention for this build or device
        found["sdpa_cudnn_ms"], found["sdpa_cudnn_reason"] = None, str(exc).splitlines()[0]
    found["fp8_ms"] = median_ms(lambda: fp8_attention(q, k, v, scale), args.warmup, args.runs)
    for ref in ("flash", "cudnn"):
        if found[f"sdpa_{ref}_ms"]:
            found[f"fp8_over_{ref}"] = round(found["fp8_ms"] / found[f"sdpa_{ref}_ms"], 4)
    exact = sdpa(*(x.float() for x in heads_first)).transpose(1, 2)
    got = fp8_attention(q, k, v, scale)
    found |= accuracy("fp8", got, exact)
    found |= accuracy("bf16_sdpa", sdpa(*heads_first).transpose(1, 2), exact)
    if args.seq * args.batch * args.heads <= 4608 * 24:  # (the emulation holds S x S floats)
        found["kernel_vs_emulation_sqnr_db"] = round(sqnr_db(emulate(q, k, v, scale), got), 2)
    return found


def measure_masked(
    args: argparse.Namespace, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor
) -> dict[str, Any]:
    scale = args.dim**-0.5
    mask = keep[:, None, None, :]
    heads_first = [x.transpose(1, 2).contiguous() for x in (q, k, v)]

    def masked() -> torch.Tensor:
        return F.scaled_dot_product_attention(*heads_first, attn_mask=mask)

    found = {"sdpa_masked_ms": median_ms(masked, args.warmup, args.runs)}
    found["fp8_ms"] = median_ms(lambda: fp8_attention(q, k, v, scale, keep), args.warmup, args.runs)
    found["fp8_over_masked"] = round(found["fp8_ms"] / found["sdpa_masked_ms"], 4)
    exact = F.scaled_dot_product_attention(
        *(x.float() for x in heads_first), attn_mask=mask
    ).transpose(1, 2)
    got = fp8_attention(q, k, v, scale, keep)
    found |= accuracy("fp8", got, exact) | accuracy("bf16_sdpa", masked().transpose(1, 2), exact)
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4608, help="tokens (FLUX.1: 4096 image + 512)")
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--dim", type=int, default=128, choices=(64, 128))
    ap.add_argument("--outliers", action="store_true")
    ap.add_argument("--text", type=int, default=512, help="with --real-text: the text's tokens")
    ap.add_argument("--real-text", type=int, help="a padded text: its real tokens (a mask)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--out-dir", default="bench/results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("the kernel runs on CUDA (compute capability 8.9 or newer)")
    found = measure(args)
    key = f"b{args.batch}-s{args.seq}-h{args.heads}-d{args.dim}" + ("-outliers" * args.outliers)
    if args.real_text is not None:
        key += f"-text{args.real_text}of{args.text}"
    with merge_result("fp8_attention", key, found, args.out_dir) as merged:
        print(json.dumps({key: merged}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
