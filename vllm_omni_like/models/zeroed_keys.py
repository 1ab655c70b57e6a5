"""Attention over padded keys at the unmasked kernel's speed (Qwen-Image, Z-Image).

A masked SDPA call falls off the fastest kernels: on an H200, one Qwen-Image block's attention
of true CFG's two rows at 1024x1024 took 1.10-1.41 ms masked against 0.66-0.88 ms unmasked at
the same length (text buckets 64-512), the whole eager forward 5-6% longer
(bench/results/masked_attention-h200.json). So the mask is not passed to the kernel: each
padded key and value is zeroed, which adds exactly exp(0) = 1 per padded key to a query's
softmax sum and nothing to its numerator, and the unmasked call's log-sum-exp takes that back
out - the same softmax over the same keys in one unmasked call (compiled 0.95-0.99 ms there),
and a row's result still independent of its neighbours' padding.
"""

from __future__ import annotations

import torch


def unmasked_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention (B, H, S, D) with each query's log-sum-exp (B, H, S, 1, float32), through the
    kernel unmasked SDPA takes on this device: cuDNN's on a Hopper GPU (flash's ran 1.7x
    slower there), flash's elsewhere on CUDA, the CPU's flash kernel on the CPU."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    elif torch.cuda.get_device_capability(q.device) >= (9, 0):
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)[:2]
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v)[:2]
    return out, lse.reshape(*out.shape[:-1], 1).float()


def has_lse_kernel(x: torch.Tensor) -> bool:
    """Whether `unmasked_with_lse` runs for tensors like `x` (CUDA's kernels: half precision)."""
    return x.device.type == "cpu" or x.dtype in (torch.float16, torch.bfloat16)


def zeroed_keys_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v over the keys `keep` (B, S) marks True, in one unmasked call,
    in the (B, S, H, D) layout of diffusers' processors. A padded key and value set to zero add
    exactly exp(0) = 1 per padded key to each query's softmax sum and nothing to its
    numerator, so the unmasked output times sum / (sum - padded keys) is the masked one (in
    float32, from the log-sum-exp: it loses precision only where a query's real keys together
    weigh far less than its padded ones, all their logits far below 0)."""
    kept = keep[:, :, None, None]
    k, v = (torch.where(kept, x, torch.zeros_like(x)) for x in (k, v))
    out, lse = unmasked_with_lse(*(x.transpose(1, 2) for x in (q, k, v)))
    padded = (keep.shape[1] - keep.sum(dim=1)).to(lse.dtype)[:, None, None, None]
    out = out.float() / (1 - padded * torch.exp(-lse))
    return out.to(q.dtype).transpose(1, 2)
