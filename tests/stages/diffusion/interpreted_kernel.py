"""The FP8 attention kernel run by Triton's interpreter against its emulation, in a process of
its own: Triton decides at its import whether its functions (`tl.max`'s, ours) are
interpreted, so TRITON_INTERPRET=1 must be set before anything imports Triton.

    TRITON_INTERPRET=1 python -m tests.stages.diffusion.interpreted_kernel

prints one JSON object: per case, the kernel's SQNR (dB) against the emulation, the largest
difference in bf16 steps (of the emulation's value), and whether the output has the query's
shape and dtype, contiguous. (Triton 3.6's interpreter, the GPU host's torch 2.11's Triton,
gives the same figures once the key blocks' count is a constant: its `range` cannot take a
runtime bound under numpy 2.)
"""

from __future__ import annotations

import json
import os

import torch

from vllm_omni_like.stages.diffusion.fp8 import sqnr_db
from vllm_omni_like.stages.diffusion.fp8_attention import emulate, run_kernel

# (batch, queries, heads, head size, keys): a tail block, fewer keys than queries, whole blocks
# (then `masked`, `blank`, `strided` and `far`, below)
CASES = {
    "tail": (1, 200, 2, 64, 200),
    "cross": (2, 130, 1, 128, 70),
    "whole": (1, 256, 1, 64, 256),
}
FAR_PAD = 4096  # elements past 2^30 in `far`'s batch stride


def compare(got: torch.Tensor, want: torch.Tensor, like: torch.Tensor) -> dict[str, object]:
    same = got.shape == like.shape and got.dtype == like.dtype and got.is_contiguous()
    step = 2.0 ** (torch.floor(torch.log2(want.float().abs().clamp(min=2**-20))) - 7)
    steps = ((got.float() - want.float()).abs() / step).max().item()
    return {"sqnr_db": sqnr_db(want, got), "max_bf16_steps": steps, "like_q": same}


def main() -> dict[str, dict[str, object]]:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run me with TRITON_INTERPRET=1"
    g = torch.Generator().manual_seed(2)
    found = {}
    for name, (b, s, h, d, keys) in CASES.items():
        q = torch.randn(b, s, h, d, generator=g).bfloat16()
        k, v = (torch.randn(b, keys, h, d, generator=g).bfloat16() for _ in range(2))
        got = run_kernel(q, k, v, d**-0.5)
        found[name] = compare(got, emulate(q, k, v, d**-0.5), q)
    # a key-padding mask (a padded text's): row 0 keeps its first 20 keys and its last 100,
    # row 1 all but 70 in the middle, its first key block all kept but one
    q, k, v = (torch.randn(2, 200, 2, 64, generator=g).bfloat16() for _ in range(3))
    keep = torch.ones(2, 200, dtype=torch.bool)
    keep[0, 20:100], keep[1, 63:133] = False, False
    got = run_kernel(q, k, v, 0.125, keep)
    found["masked"] = compare(got, emulate(q, k, v, 0.125, keep), q)
    keep[1] = False  # row 1 keeps no key: zeros out, not a 0 / 0
    got = run_kernel(q, k, v, 0.125, keep)
    found["blank"] = compare(got, emulate(q, k, v, 0.125, keep), q)
    found["blank"]["zeros"] = bool(torch.equal(got[1], torch.zeros_like(got[1])))
    # FLUX.1's fused QKV: views of one (B, S, 3 H D) projection, not contiguous
    fused = torch.randn(1, 140, 3 * 2 * 64, generator=g).bfloat16()
    q, k, v = (x.unflatten(-1, (2, 64)) for x in fused.chunk(3, dim=-1))
    got = run_kernel(q, k, v, 0.125)
    found["strided"] = compare(got, emulate(q, k, v, 0.125), q) | {"q_strided": True}
    found["far"] = far(g)
    return found


def far(g: torch.Generator) -> dict[str, object]:
    """Offsets past 2^31 elements (Wan2.2 at 720p, 81 frames, 6 rows: 2.3e9): Q, K and V as
    views of one storage of 2^31 + a few elements whose batch stride is 2^30 + FAR_PAD, so
    the third batch row starts past int32's range while each stride fits int32 (Triton passes
    it as one). Only the pages of the rows written are touched (the storage is not filled)."""
    b, s, h, d = 3, 70, 2, 64
    row = s * h * d
    stride = 2**30 + FAR_PAD
    storage = torch.empty(2 * stride + 3 * row, dtype=torch.bfloat16)
    views = [storage.as_strided((b, s, h, d), (stride, h * d, d, 1), i * row) for i in range(3)]
    for view in views:
        view.copy_(torch.randn(b, s, h, d, generator=g).bfloat16())
    q, k, v = views
    assert views[0].storage_offset() + 2 * stride + row > 2**31  # (the far row's end)
    got = run_kernel(q, k, v, 0.125)
    want = emulate(q.contiguous(), k.contiguous(), v.contiguous(), 0.125)
    return compare(got, want, q.contiguous()) | {"offset": 2 * stride}


if __name__ == "__main__":
    print(json.dumps(main()))
