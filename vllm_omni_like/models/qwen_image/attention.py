"""Qwen-Image's joint attention over padded texts, at the unmasked kernel's speed.

A row's text is padded to a length bucket and its padding masked (adapter.py); the mask is not
passed to the kernel but taken into account by `zeroed_keys_attention` (models/zeroed_keys.py):
padded keys and values zeroed, one unmasked call corrected by its log-sum-exp.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.transformers.transformer_qwenimage import (
    QwenDoubleStreamAttnProcessor2_0,
    apply_rotary_emb_qwen,
)

from vllm_omni_like.models.zeroed_keys import has_lse_kernel, zeroed_keys_attention


def zeroed_padding_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, text_mask: torch.Tensor
) -> torch.Tensor:
    """Attention over keys [text (T, `text_mask` False where padded), image] with the padded
    text keys left out (`zeroed_keys_attention`), (B, S, H, D)."""
    texts = text_mask.shape[1]
    keep = torch.cat([text_mask, text_mask.new_ones(q.shape[0], q.shape[1] - texts)], dim=1)
    return zeroed_keys_attention(q, k, v, keep)


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
