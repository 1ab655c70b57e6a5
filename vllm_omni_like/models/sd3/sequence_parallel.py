"""An SD3 transformer (SD3.5-medium, SD3.5-large) over a sequence-parallel replica's ranks
(parallel/ulysses.py): which tokens each rank holds, where they are split and gathered, and its
attentions over all of them.

- The image's patch tokens are split as they leave `pos_embed` (their positions already added:
  a learned table cropped to the image, no RoPE, so each token carries its global position
  from there on) and gathered from `proj_out`'s output, before the unpatchify.
- The text tokens (two CLIPs' and T5's) stay whole on every rank, and every rank computes their
  stream alike: in the joint attention each rank takes its own heads of them and their outputs
  are gathered head-wise; only the image tokens are exchanged. The last block's text output is
  unused (`context_pre_only`), as on one rank.
- MMDiT-X's second attention (SD3.5-medium's `attn2`, over the image tokens alone) exchanges
  them the same way, with no text.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.attention_processor import JointAttnProcessor2_0

from vllm_omni_like.parallel.ulysses import SequenceShards, UlyssesProcessor


def _qkv(attn: Any, states: torch.Tensor, added: bool) -> list[torch.Tensor]:
    """Queries, keys and values (B, S, H, D) of one stream (`added`: the text's), through its
    projections (fused or not) and QK norms."""
    if added:
        fused, names, norms = "to_added_qkv", ("add_q_proj", "add_k_proj", "add_v_proj"), "added_"
    else:
        fused, names, norms = "to_qkv", ("to_q", "to_k", "to_v"), ""
    if getattr(attn, "fused_projections", False):
        qkv = list(getattr(attn, fused)(states).chunk(3, dim=-1))
    else:
        qkv = [getattr(attn, name)(states) for name in names]
    qkv = [x.unflatten(-1, (attn.heads, -1)) for x in qkv]
    for i, which in ((0, "q"), (1, "k")):
        norm = getattr(attn, f"norm_{norms}{which}")
        if norm is not None:
            qkv[i] = norm(qkv[i])
    return qkv


class UlyssesSD3Attention(UlyssesProcessor, JointAttnProcessor2_0):  # type: ignore[misc]  # untyped
    """An SD3 block's joint attention over [text, image] (`encoder_hidden_states` the text), or
    its image-only one (none), as diffusers' processor computes them, the image tokens this
    rank's share. (The keys' order, text first, changes no softmax.)"""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if attention_mask is not None:
            raise ValueError("a sequence-parallel SD3 attention takes no mask")
        q, k, v = _qkv(attn, hidden_states, added=False)
        texts = 0
        if encoder_hidden_states is not None:
            texts = encoder_hidden_states.shape[1]
            text_q, text_k, text_v = _qkv(attn, encoder_hidden_states, added=True)
            q, k, v = (torch.cat(pair, dim=1) for pair in ((text_q, q), (text_k, k), (text_v, v)))
        out = self.exchange(q, k, v, replicated=texts)
        image = attn.to_out[1](attn.to_out[0](out[:, texts:].contiguous()))
        if encoder_hidden_states is None:
            return image
        text = out[:, :texts]
        if not attn.context_pre_only:
            text = attn.to_add_out(text.contiguous())
        return image, text


def split_sd3(model: Any, shards: SequenceShards) -> None:
    """Make `model` (an SD3Transformer2DModel, not yet compiled) hold this rank's share of its
    image tokens and attend over every rank's (hooks and processors: its weights untouched)."""
    model.pos_embed.register_forward_hook(lambda m, a, out: shards.shard(out, 1))
    model.proj_out.register_forward_hook(lambda m, a, out: shards.gather(out, 1))
    for block in model.transformer_blocks:
        block.attn.set_processor(UlyssesSD3Attention(shards))
        if block.attn2 is not None:
            block.attn2.set_processor(UlyssesSD3Attention(shards))
