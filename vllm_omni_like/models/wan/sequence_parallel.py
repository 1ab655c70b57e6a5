"""A Wan transformer over a sequence-parallel replica's ranks (parallel/ulysses.py): which tokens
each rank holds, where they are split and gathered, and its self-attention over all of them.

- The latent tokens (frames x height x width patches, flattened) are split where the blocks
  take them (`blocks.0`'s input) and gathered from `proj_out`'s output, before the unpatchify.
- RoPE: the whole sequence's table is made as one rank makes it, then each rank takes its
  share, so its tokens keep their global positions.
- A timestep per token (Wan2.2-TI2V) is split the same way before it is embedded, so each
  token's modulation stays with it.
- The text (and Wan2.1-I2V's CLIP image tokens) stays whole on every rank: the cross-attention
  takes this rank's tokens as queries and every text token as keys, so it runs as it is; the
  self-attention exchanges heads for tokens (Ulysses).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.transformers.transformer_wan import (
    WanAttnProcessor,
    _get_qkv_projections,
)

from vllm_omni_like.parallel.ulysses import SequenceShards, UlyssesProcessor

Args = tuple[Any, ...]
Kwargs = dict[str, Any]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Wan's rotary embedding: each pair of channels (2i, 2i+1) turned by its angle."""
    even, odd = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    turned = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return turned.flatten(-2).type_as(x)


class UlyssesSelfAttention(UlyssesProcessor, WanAttnProcessor):  # type: ignore[misc]  # untyped
    """A Wan block's self-attention (`attn1`: projections, QK norms across heads, RoPE and the
    output projection as diffusers' processor has them) over every rank's tokens."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("a sequence-parallel self-attention takes no text and no mask")
        q, k, v = _get_qkv_projections(attn, hidden_states, None)
        q, k = attn.norm_q(q), attn.norm_k(k)
        q, k, v = (x.unflatten(2, (attn.heads, -1)) for x in (q, k, v))
        if rotary_emb is not None:
            q, k = rotate(q, *rotary_emb), rotate(k, *rotary_emb)
        out = self.exchange(q, k, v)
        projected: torch.Tensor = attn.to_out[1](attn.to_out[0](out))
        return projected


def split_wan(model: Any, shards: SequenceShards) -> None:
    """Make `model` (a WanTransformer3DModel, not yet compiled) hold this rank's share of its
    tokens and attend over every rank's (hooks and processors: its weights are untouched)."""

    def tokens(module: Any, args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs]:
        if args:
            return (shards.shard(args[0], 1), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": shards.shard(kwargs["hidden_states"], 1)}

    def timesteps(module: Any, args: Args, kwargs: Kwargs) -> tuple[Args, Kwargs] | None:
        length = kwargs.get("timestep_seq_len")
        if length is None:  # one timestep a row: nothing per token
            return None
        per_token = shards.shard(args[0].reshape(-1, length), 1, record=False)
        return (per_token.flatten(), *args[1:]), {**kwargs, "timestep_seq_len": per_token.shape[1]}

    model.rope.register_forward_hook(lambda m, a, out: tuple(shards.shard(f, 1) for f in out))
    model.condition_embedder.register_forward_pre_hook(timesteps, with_kwargs=True)
    model.blocks[0].register_forward_pre_hook(tokens, with_kwargs=True)
    model.proj_out.register_forward_hook(lambda m, a, out: shards.gather(out, 1))
    for block in model.blocks:
        block.attn1.set_processor(UlyssesSelfAttention(shards))
