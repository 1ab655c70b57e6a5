"""Qwen-Image's joint attention over padded texts, at the unmasked kernel's speed.

A row's text is padded to a length bucket and its padding masked (adapter.py), and a masked
SDPA call falls off the fastest kernels: on an H200, one block's attention of true CFG's two
rows at 1024x1024 took 1.10-1.41 ms masked against 0.66-0.88 ms unmasked at the same length
(text buckets 64-512), and the whole eager forward 5-6% longer (354.7 against 336.0 ms;
bench/results/masked_attention-h200.json, models-h200.json). So the mask is not passed to the
kernel: each padded key and value is zeroed, which adds exactly exp(0) = 1 per padded token to
a query's softmax sum and nothing to its numerator, and the unmasked call's log-sum-exp takes
that back out - the same softmax over the same keys in one unmasked call, and a row's result
still independent of its neighbours' texts.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.transformers.transformer_qwenimage import (
    QwenDoubleStreamAttnProcessor2_0,
    apply_rotary_emb_qwen,
)


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


def zeroed_padding_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, text_mask: torch.Tensor
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v over keys [text (T, `text_mask` False where padded), image]
    in one unmasked call, in the (B, S, H, D) layout of diffusers' processors. A padded key
    and value set to zero add exactly exp(0) = 1 per padded token to each query's softmax sum
    and nothing to its numerator, so the unmasked output times sum / (sum - padded tokens) is
    the masked one (in float32, from the log-sum-exp: it loses precision only where a
    query's real keys together weigh far less than its padded ones, all their logits far
    below 0)."""
    texts = text_mask.shape[1]
    keep = torch.cat([text_mask, text_mask.new_ones(q.shape[0], q.shape[1] - texts)], dim=1)
    keep = keep[:, :, None, None]
    k, v = (torch.where(keep, x, torch.zeros_like(x)) for x in (k, v))
    out, lse = unmasked_with_lse(*(x.transpose(1, 2) for x in (q, k, v)))
    padded = (texts - text_mask.sum(dim=1)).to(lse.dtype)[:, None, None, None]
    out = out.float() / (1 - padded * torch.exp(-lse))
    return out.to(q.dtype).transpose(1, 2)


class PaddedTextAttnProcessor(QwenDoubleStreamAttnProcessor2_0):  # type: ignore[misc]  # untyped
    """The double-stream block's attention (projections, QK norms, RoPE, output projections as
    diffusers' processor has them) with `zeroed_padding_attention` for a masked text; without a
    mask (or no kernel with a log-sum-exp for it: float32 on CUDA), diffusers' own."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if (
            encoder_hidden_states is None
            or encoder_hidden_states_mask is None
            or not has_lse_kernel(hidden_states)
        ):
            out: tuple[torch.Tensor, torch.Tensor] = super().__call__(
                attn,
                hidden_states,
                encoder_hidden_states,
                encoder_hidden_states_mask,
                attention_mask,
                image_rotary_emb,
            )
            return out
        q, k, v = joint_qkv(attn, hidden_states, encoder_hidden_states, image_rotary_emb)
        joint = zeroed_padding_attention(q, k, v, encoder_hidden_states_mask.bool()).flatten(2, 3)
        texts = encoder_hidden_states.shape[1]
        image_out = attn.to_out[0](joint[:, texts:].contiguous())
        if len(attn.to_out) > 1:
            image_out = attn.to_out[1](image_out)  # (dropout)
        return image_out, attn.to_add_out(joint[:, :texts].contiguous())


def joint_qkv(
    attn: Any, image_states: torch.Tensor, text_states: torch.Tensor, rotary: Any
) -> list[torch.Tensor]:
    """Queries, keys and values (B, S, H, D) of [text, image] as diffusers' processor makes
    them: each stream's projections, QK norms and rotary embedding."""
    head_dim = attn.inner_dim // attn.heads
    image = [p(image_states) for p in (attn.to_q, attn.to_k, attn.to_v)]
    text = [p(text_states) for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
    image = [x.unflatten(-1, (-1, head_dim)) for x in image]
    text = [x.unflatten(-1, (-1, head_dim)) for x in text]
    for i, (image_norm, text_norm) in enumerate(
        ((attn.norm_q, attn.norm_added_q), (attn.norm_k, attn.norm_added_k))
    ):
        image[i] = image[i] if image_norm is None else image_norm(image[i])
        text[i] = text[i] if text_norm is None else text_norm(text[i])
    if rotary is not None:
        image_freqs, text_freqs = rotary
        for i in (0, 1):
            image[i] = apply_rotary_emb_qwen(image[i], image_freqs, use_real=False)
            text[i] = apply_rotary_emb_qwen(text[i], text_freqs, use_real=False)
    return [torch.cat([t, x], dim=1) for t, x in zip(text, image, strict=True)]


def use_padded_text_attention(transformer: Any) -> bool:
    """Give each double-stream block of a Qwen-Image transformer `PaddedTextAttnProcessor`;
    whether every block had diffusers' processor (another one, e.g. fused, stays)."""
    processors = transformer.attn_processors
    if not processors or any(
        type(p) is not QwenDoubleStreamAttnProcessor2_0 for p in processors.values()
    ):
        return False
    transformer.set_attn_processor(PaddedTextAttnProcessor())
    return True
