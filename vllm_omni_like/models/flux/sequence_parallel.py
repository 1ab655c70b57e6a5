"""A FLUX.1 transformer over a sequence-parallel replica's ranks (parallel/ulysses.py): which
tokens each rank holds, where they are split and gathered, and its joint attention over all.

- The packed image tokens are split as they enter (`x_embedder`'s input) and gathered from
  `proj_out`'s output.
- The text tokens (T5's) stay whole on every rank, and every rank computes their stream alike:
  in a joint attention each rank takes its own heads of them and their outputs are gathered
  head-wise; only the image tokens are exchanged.
- RoPE: the table of [text, image] positions is made whole, as one rank makes it, then the
  image part is cut to this rank's share, so its tokens keep their global positions.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import (
    FluxAttnProcessor,
    _get_qkv_projections,
)

from vllm_omni_like.parallel.ulysses import SequenceShards, UlyssesProcessor


class UlyssesJointAttention(UlyssesProcessor, FluxAttnProcessor):  # type: ignore[misc]  # untyped
    """A FLUX.1 block's joint attention over [text, image] (projections, QK norms, RoPE and
    output projections as diffusers' processor has them): a double-stream block's text comes
    apart (`encoder_hidden_states`), a single-stream block's is the first tokens of its
    input."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Any:
        if attention_mask is not None:
            raise ValueError("a sequence-parallel joint attention takes no mask")
        q, k, v, text_q, text_k, text_v = _get_qkv_projections(
            attn, hidden_states, encoder_hidden_states
        )
        q, k, v = (x.unflatten(-1, (-1, attn.head_dim)) for x in (q, k, v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        if encoder_hidden_states is not None:  # double stream: [text, image] joined here
            texts = encoder_hidden_states.shape[1]
            text_q, text_k, text_v = (
                x.unflatten(-1, (-1, attn.head_dim)) for x in (text_q, text_k, text_v)
            )
            text_q, text_k = attn.norm_added_q(text_q), attn.norm_added_k(text_k)
            q, k, v = (torch.cat(pair, dim=1) for pair in ((text_q, q), (text_k, k), (text_v, v)))
        else:  # single stream: the tokens before this rank's image share are the text's
            texts = hidden_states.shape[1] - self.shards.local(self.shards.length)
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        out = self.exchange(q, k, v, replicated=texts)
        if encoder_hidden_states is None:
            return out
        image = attn.to_out[1](attn.to_out[0](out[:, texts:].contiguous()))
        return image, attn.to_add_out(out[:, :texts].contiguous())


def split_flux(model: Any, shards: SequenceShards) -> None:
    """Make `model` (a FluxTransformer2DModel, not yet compiled) hold this rank's share of its
    image tokens and attend over every rank's (hooks and processors: its weights untouched)."""

    def tokens(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (shards.shard(args[0], 1), *args[1:])

    def rope(module: Any, args: Any, out: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        texts = out[0].shape[0] - shards.length  # (the image's length: set by `tokens`)
        return tuple(torch.cat([f[:texts], shards.shard(f[texts:], 0, record=False)]) for f in out)

    model.x_embedder.register_forward_pre_hook(tokens)
    model.pos_embed.register_forward_hook(rope)
    model.proj_out.register_forward_hook(lambda m, a, out: shards.gather(out, 1))
    for block in (*model.transformer_blocks, *model.single_transformer_blocks):
        block.attn.set_processor(UlyssesJointAttention(shards))
