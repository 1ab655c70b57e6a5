"""What a text mask costs the attention of a joint (text + image) transformer, per SDPA kernel
and per text-length bucket (#38: Qwen-Image's rows are padded to `TEXT_BUCKETS` with a mask).

    python bench/masked_attention.py                      # one GPU: Qwen-Image's 1024x1024 shape
    python bench/masked_attention.py --heads 30 --device cpu --image-tokens 256 --runs 2  # smoke

One attention call of one block, bf16, the model's heads and head dimension, `--rows` rows (2:
true CFG's two branches of one request, whose texts have lengths `--lengths`), the image's
tokens after the text's. For each bucket: the same length unmasked (every text token real),
masked with each SDPA kernel that takes a mask, and - what diffusers' own pipeline does - one
unmasked call per row at the row's own length - and the server's way (padded keys and values
zeroed, one unmasked call corrected by its log-sum-exp; its error against the masked call;
`--compiled`: it and the masked call under torch.compile too). Medians of
`--runs` calls on the device's clock.
Writes `bench/results/masked_attention-<device>.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.cli_flags import add_outputs, parser
from bench.raw_diffusers import device_name
from vllm_omni_like.models.qwen_image.attention import zeroed_padding_attention
from vllm_omni_like.models.text_buckets import TEXT_BUCKETS

KERNELS = {
    "default": None,  # what PyTorch picks (the server's choice: it sets none)
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


def once_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Milliseconds of one call of `fn` (CUDA events on a GPU, the host's clock elsewhere)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def clock(fn: Callable[[], Any], runs: int, device: torch.device, warmup: int = 2) -> float:
    """Median milliseconds of `fn` (after `warmup` calls; CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    return statistics.median(once_ms(fn, device) for _ in range(runs))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, kernel: str) -> Any:
    backend = KERNELS[kernel]
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def bucket_row(args: argparse.Namespace, bucket: int, device: torch.device) -> dict[str, Any]:
    """Milliseconds of one block's attention at one text bucket, by way of computing it."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    total = bucket + args.image_tokens
    shape = (args.rows, args.heads, total, args.head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype) for _ in range(3))
    mask = torch.ones(args.rows, 1, 1, total, dtype=torch.bool, device=device)
    for row, length in enumerate(args.lengths[: args.rows]):
        mask[row, ..., min(length, bucket) : bucket] = False  # the row's padding
    out: dict[str, Any] = {"bucket": bucket}
    for kernel in KERNELS:
        for name, m in (("unmasked", None), ("masked", mask)):
            try:
                out[f"{name}_{kernel}_ms"] = round(
                    clock(lambda m=m, kernel=kernel: attend(q, k, v, m, kernel), args.runs, device),
                    3,
                )
            except RuntimeError as exc:  # this kernel does not take this call here
                out[f"{name}_{kernel}_ms"] = None
                print(
                    f"{bucket} {name} {kernel}: {str(exc).splitlines()[0][:120]}", file=sys.stderr
                )

    def per_row() -> None:  # diffusers' pipeline: each branch alone, at its own length
        for row, length in enumerate(args.lengths[: args.rows]):
            n = min(length, bucket) + args.image_tokens
            sl = slice(bucket - min(length, bucket), total)  # (any n tokens: same cost)
            attend(
                q[row : row + 1, :, sl],
                k[row : row + 1, :, sl],
                v[row : row + 1, :, sl],
                None,
                "default",
            )
            assert sl.stop - sl.start == n

    out["per_row_unmasked_ms"] = round(clock(per_row, args.runs, device), 3)
    # the server's way (models/qwen_image/attention.py): padding zeroed, one unmasked call
    text_mask = mask[:, 0, 0, :bucket]
    layout = [x.transpose(1, 2) for x in (q, k, v)]  # (B, S, H, D), as diffusers' processors
    want = attend(q, k, v, mask, "default").float()
    got = zeroed_padding_attention(*layout, text_mask).transpose(1, 2).float()
    out["zeroed_max_abs_err"] = float((got - want).abs().max())
    out["zeroed_rel_err"] = float((got - want).norm() / want.norm())
    out["zeroed_ms"] = round(
        clock(lambda: zeroed_padding_attention(*layout, text_mask), args.runs, device), 3
    )
    if args.compiled:  # as the server runs them: inside a compiled forward
        options = {"fullgraph": True, "dynamic": False}
        zeroed = torch.compile(zeroed_padding_attention, **options)
        masked = torch.compile(F.scaled_dot_product_attention, **options)
        out["compiled_zeroed_ms"] = round(
            clock(lambda: zeroed(*layout, text_mask), args.runs, device), 3
        )
        out["compiled_masked_ms"] = round(
            clock(lambda: masked(q, k, v, attn_mask=mask), args.runs, device), 3
        )
    return out


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--heads", type=int, default=24)  # Qwen-Image: 24 x 128
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--image-tokens", type=int, default=4096)  # 1024x1024: (1024 / 16) ** 2
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[34, 6])  # a prompt, " "
    ap.add_argument("--buckets", type=int, nargs="+", default=list(TEXT_BUCKETS))
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compiled", action="store_true", help="also both under torch.compile")
    add_outputs(ap)
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = [bucket_row(args, b, device) for b in args.buckets]
    for r in rows:
        print(json.dumps(r), file=sys.stderr)
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "shape": {
            k: getattr(args, k) for k in ("heads", "head_dim", "image_tokens", "rows", "lengths")
        },
        "buckets": rows,
    }
    os.makedirs(args.out_dir, exist_ok=True)
    name = device_name() if device.type == "cuda" else "cpu"
    with open(os.path.join(args.out_dir, f"masked_attention-{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
