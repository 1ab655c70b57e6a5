"""The Triton kernels of `--attention fp8` (fp8_attention.py says the maths; this file runs it).

Two launches a call:
1. `_quantize_kv`, one program a block of BLOCK_N keys of one (batch, head): K minus its mean
   over the sequence, over the block's largest magnitude -> e4m3 and one float32 scale a
   block; V over its per-channel scales -> e4m3, written transposed (head_dim, sequence), the
   layout the FP8 tensor cores take a product's second operand in (its reduction dimension,
   the keys, contiguous).
2. `_attention`, one program a block of BLOCK_M queries of one (batch, head): its queries
   (times the softmax scale and log2(e)) quantized per block in registers, then over the key
   blocks flash attention's online softmax in base 2: S = (Q8 K8^T) q_scale k_scale, P =
   exp2(S - running max), P * 448 cast to e4m3, O += P8 V8 (both products in float32), the row
   sums from P before its cast; at the end O * v_scale / 448 / row sum, in bf16. With a
   key-padding mask (`keep`, one byte a key), the keys it leaves out score -inf.

Offsets are int64 (the program ids cast before any offset is formed): a tensor of Wan2.2 at
720p, 81 frames and 6 rows (2.3e9 elements) has offsets past int32's range, where int32 ones
would wrap round (tests/stages/diffusion/interpreted_kernel.py's `far` case).

Kept to what Triton 3.x has long had (pointer arithmetic, `tl.dot` of float8e4nv operands,
`tl.trans`, `tl.exp2`): the GPU host's torch 2.11 ships its own Triton. Under the interpreter
(`TRITON_INTERPRET=1`, the CPU tests) a float32 -> e4m3 cast does not round to nearest even
(it drops the carry into the exponent), so there `ROUND` rounds onto e4m3's grid first with
float32 bit arithmetic and the cast is exact; on a GPU the cast's own rounding (to nearest
even, saturating) runs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _e4m3(x, ROUND: tl.constexpr):
    """`x` (float32, within +-448) cast to float8e4nv, rounded to nearest even."""
    if ROUND:
        bits = x.to(tl.int32, bitcast=True)  # 3 mantissa bits kept, ties to even
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
        normal = bits.to(tl.float32, bitcast=True)
        tiny = (x + 24576.0) - 24576.0  # e4m3's subnormals: a multiple of 2^-9
        x = tl.where(tl.abs(x) < 0.015625, tiny, normal)
    return x.to(tl.float8e4nv)


@triton.jit
def _quantize_kv(
    k_ptr, v_ptr, mean_ptr, vscale_ptr, k8_ptr, kscale_ptr, v8_ptr,
    stride_b, stride_h, stride_s, S, S_PAD, H, BLOCKS,
    D: tl.constexpr, BLOCK_N: tl.constexpr, ROUND: tl.constexpr,
):  # fmt: skip
    block, bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)  # (offsets)
    b, h = bh // H, bh % H
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    inside = n[:, None] < S
    at = b * stride_b + h * stride_h + n[:, None] * stride_s + d[None, :]
    k = tl.load(k_ptr + at, mask=inside, other=0.0).to(tl.float32)
    k = tl.where(inside, k - tl.load(mean_ptr + bh * D + d)[None, :], 0.0)
    k_scale = tl.maximum(tl.max(tl.abs(k)), 1e-12) / 448.0
    tl.store(kscale_ptr + bh * BLOCKS + block, k_scale)
    k8 = _e4m3(tl.minimum(tl.maximum(k / k_scale, -448.0), 448.0), ROUND)
    tl.store(k8_ptr + bh * S_PAD * D + n[:, None] * D + d[None, :], k8)
    v = tl.load(v_ptr + at, mask=inside, other=0.0).to(tl.float32)
    v = v / tl.load(vscale_ptr + bh * D + d)[None, :]
    v8 = _e4m3(tl.minimum(tl.maximum(v, -448.0), 448.0), ROUND)
    tl.store(v8_ptr + bh * D * S_PAD + d[None, :] * S_PAD + n[:, None], v8)


@triton.jit
def _query_block(q_ptr, b, h, m, S, stride_b, stride_h, stride_s, qk_scale, D: tl.constexpr,
                 ROUND: tl.constexpr):  # fmt: skip
    """A block of queries times the softmax scale in base 2, in e4m3, and its scale."""
    d = tl.arange(0, D)
    at = b * stride_b + h * stride_h + m[:, None] * stride_s + d[None, :]
    q = tl.load(q_ptr + at, mask=m[:, None] < S, other=0.0).to(tl.float32) * qk_scale
    q_scale = tl.maximum(tl.max(tl.abs(q)), 1e-12) / 448.0
    return _e4m3(tl.minimum(tl.maximum(q / q_scale, -448.0), 448.0), ROUND), q_scale


@triton.jit
def _attention(
    q_ptr, k8_ptr, kscale_ptr, v8_ptr, vscale_ptr, o_ptr, keep_ptr,
    stride_b, stride_h, stride_s, o_stride_b, o_stride_h, o_stride_s,
    S_Q, S, S_PAD, H, BLOCKS, qk_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr,
    KEEP: tl.constexpr, ROUND: tl.constexpr,
):  # fmt: skip
    block, bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)  # (offsets)
    b, h = bh // H, bh % H
    m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    q8, q_scale = _query_block(
        q_ptr, b, h, m, S_Q, stride_b, stride_h, stride_s, qk_scale, D, ROUND
    )
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for j in range(0, BLOCKS):
        n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        k8 = tl.load(k8_ptr + bh * S_PAD * D + n[:, None] * D + d[None, :])
        scores = tl.dot(q8, tl.trans(k8)) * (q_scale * tl.load(kscale_ptr + bh * BLOCKS + j))
        if not EVEN:
            scores = tl.where(n[None, :] < S, scores, float("-inf"))
        if KEEP:  # a key-padding mask: the keys it leaves out out of the softmax
            kept = tl.load(keep_ptr + b * S + n, mask=n < S, other=0)
            scores = tl.where(kept[None, :] != 0, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)  # (no key yet)
        alpha = tl.exp2(row_max - safe)
        p = tl.exp2(scores - safe[:, None])
        row_sum = row_sum * alpha + tl.sum(p, 1)
        v8 = tl.load(v8_ptr + bh * D * S_PAD + d[None, :] * S_PAD + n[:, None])
        acc = acc * alpha[:, None] + tl.dot(_e4m3(p * 448.0, ROUND), v8)
        row_max = new_max
    v_scale = tl.load(vscale_ptr + bh * D + d)
    row_sum = tl.where(row_sum > 0.0, row_sum, 1.0)  # (no key kept: 0 out, as SDPA gives)
    out = acc * (v_scale[None, :] / 448.0) / row_sum[:, None]
    at = b * o_stride_b + h * o_stride_h + m[:, None] * o_stride_s + d[None, :]
    tl.store(o_ptr + at, out.to(o_ptr.dtype.element_ty), mask=m[:, None] < S_Q)


def fp8_attention_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qk_scale: float,
    mean: torch.Tensor,
    v_scale: torch.Tensor,
    blocks_mn: tuple[int, int],
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * qk_scale / log2 e) v for (B, S, H, D) tensors (the processors' layout;
    keys and values may be fewer than queries), through the two kernels, with K's mean and V's
    scales (B, H, D) and the blocks (queries, keys) fp8_attention.py gives, over the keys
    `keep` (B, S) marks (none: all); the output like `q`, contiguous."""
    block_m, block_n = blocks_mn
    batch, queries, heads, dim = q.shape
    seq = k.shape[1]
    if q.stride(3) != 1:
        q = q.contiguous()
    if k.stride(3) != 1 or k.stride() != v.stride():  # one set of strides for both
        k, v = k.contiguous(), v.contiguous()
    blocks = triton.cdiv(seq, block_n)
    padded = blocks * block_n
    bh = batch * heads
    mean, v_scale = (x.reshape(bh, dim).contiguous() for x in (mean, v_scale))
    k8 = torch.empty(bh, padded, dim, device=q.device, dtype=torch.float8_e4m3fn)
    v8 = torch.empty(bh, dim, padded, device=q.device, dtype=torch.float8_e4m3fn)
    k_scale = torch.empty(bh, blocks, device=q.device, dtype=torch.float32)
    strides = (k.stride(0), k.stride(2), k.stride(1))  # batch, head, token
    _quantize_kv[(blocks, bh)](
        k, v, mean, v_scale, k8, k_scale, v8, *strides, seq, padded, heads, blocks,
        D=dim, BLOCK_N=block_n, ROUND=INTERPRETED, num_warps=4,
    )  # fmt: skip
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    kept = k_scale if keep is None else keep.contiguous().view(torch.uint8)  # (unread if none)
    _attention[(triton.cdiv(queries, block_m), bh)](
        q, k8, k_scale, v8, v_scale, out, kept,
        q.stride(0), q.stride(2), q.stride(1), out.stride(0), out.stride(2), out.stride(1),
        queries, seq, padded, heads, blocks, qk_scale,
        D=dim, BLOCK_M=block_m, BLOCK_N=block_n, EVEN=seq % block_n == 0,
        KEEP=keep is not None, ROUND=INTERPRETED,
        num_warps=8, num_stages=3,
    )  # fmt: skip
    return out
