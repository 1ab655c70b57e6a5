"""A Qwen-Image transformer over a sequence-parallel replica's ranks (parallel/ulysses.py): which
tokens each rank holds, where they are split and gathered, and its joint attention over all
(Qwen-Image-Edit's too: its sequence is the noise's tokens, then the upload's).

- The packed image tokens are split as they enter (`img_in`'s input) and gathered from
  `proj_out`'s output; a per-token modulation index (a `zero_cond_t` transformer's: the noise's
  tokens 0, the upload's 1) is split with them, as each block takes it.
- The text tokens (Qwen2.5-VL's) stay whole on every rank, and every rank computes their stream
  alike: in the joint attention each rank takes its own heads of them and their outputs are
  gathered head-wise; only the image tokens are exchanged.
- The text's mask (a row's prompt padded to its text bucket, models/text_buckets.py): each
  rank attends over [text, every image token] for its heads once exchanged, so the mask is the
  text's alone, the same on every rank; the padded text keys are left out as one rank leaves
  them out (`text_masked_attention`).
- RoPE: the image's table (every token's, the upload's after the noise's) is made whole, as one
  rank makes it, then cut to this rank's share, so its tokens keep their global positions; the
  text's table stays whole.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

from vllm_omni_like.models.qwen_image.attention import joint_qkv, zeroed_padding_attention
from vllm_omni_like.models.zeroed_keys import has_lse_kernel
from vllm_omni_like.parallel.ulysses import SequenceShards, UlyssesProcessor

Args = tuple[Any, ...]
Kwargs = dict[str, Any]


def text_masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, text_mask: torch.Tensor
) -> torch.Tensor:
    """Attention (B, S, H, D) over keys [text (T, `text_mask` False where padded), image] with
    the padded text keys left out: on CUDA in half precision in one unmasked call
    (`zeroed_padding_attention`, as one rank's fast attention), elsewhere masked SDPA (as
    diffusers' processor)."""
    if q.is_cuda and has_lse_kernel(q):
        return zeroed_padding_attention(q, k, v, text_mask)
    texts = text_mask.shape[1]
    keep = torch.cat([text_mask, text_mask.new_ones(q.shape[0], q.shape[1] - texts)], dim=1)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
    return out.transpose(1, 2)


class UlyssesQwenAttention(UlyssesProcessor, QwenDoubleStreamAttnProcessor2_0):  # type: ignore[misc]  # untyped
    """A double-stream block's joint attention over [text, image] (projections, QK norms, RoPE
    and output projections as diffusers' processor has them, `joint_qkv`), the image tokens
    this rank's share."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is None or attention_mask is not None:
            raise ValueError("a sequence-parallel Qwen-Image attention takes a text, no mask")
        q, k, v = joint_qkv(attn, hidden_states, encoder_hidden_states, image_rotary_emb)
        texts = encoder_hidden_states.shape[1]
        mask = encoder_hidden_states_mask
        attend = None
        if mask is not None:
            attend = functools.partial(text_masked_attention, text_mask=mask.bool())
        joint = self.exchange(q, k, v, replicated=texts, attend=attend)
        image_out = attn.to_out[0](joint[:, texts:].contiguous())
        if len(attn.to_out) > 1:
            image_out = attn.to_out[1](image_out)  # (dropout)
        return image_out, attn.to_add_out(joint[:, :texts].contiguous())


def split_qwen_image(model: Any, shards: SequenceShards) -> None:
    """Make `model` (a QwenImageTransformer2DModel, not yet compiled) hold this rank's share of
    its image tokens and attend over every rank's (hooks and processors: its weights
    untouched)."""

    def tokens(module: Any, args: Args) -> Args:
        return (shards.shard(args[0], 1), *args[1:])

    def rope(module: Any, args: Any, out: tuple[torch.Tensor, torch.Tensor]) -> Any:
        image, text = out
        return shards.shard(image, 0, record=False), text

    def modulation(module: Any, args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs] | None:
        index = kwargs.get("modulate_index")
        if index is None:  # (one modulation a row: nothing per token)
            return None
        return args, {**kwargs, "modulate_index": shards.shard(index, 1, record=False)}

    model.img_in.register_forward_pre_hook(tokens)
    model.pos_embed.register_forward_hook(rope)
    model.proj_out.register_forward_hook(lambda m, a, out: shards.gather(out, 1))
    for block in model.transformer_blocks:
        block.register_forward_pre_hook(modulation, with_kwargs=True)
        block.attn.set_processor(UlyssesQwenAttention(shards))
