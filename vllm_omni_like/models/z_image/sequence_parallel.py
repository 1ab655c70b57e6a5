"""A Z-Image transformer over a sequence-parallel replica's ranks (parallel/ulysses.py): which
tokens each rank holds, where they are split and gathered, and its attention over all of them.

Z-Image is one stream: each row's image tokens and caption tokens are refined apart (the noise
and context refiners, two blocks each, whole on every rank), then joined into one unified
sequence [image, caption, padding] that its main layers (30 of Z-Image-Turbo's 34 blocks) run
as one self-attention. That unified sequence is what is split:

- It is cut into the ranks' shares as the first main layer takes it, its RoPE table (a row's
  own, per token) cut the same way before every main layer, so each token keeps its global
  position; the last main layer's output is gathered (the final layer and the unpatchify run
  whole).
- Its mask (rows whose captions differ in length, or padded to a caption bucket:
  models/z_image/sequence.py) is a mask of keys over the whole sequence, the same on every rank:
  once exchanged each rank attends over every token for its heads, and the padded keys are left
  out as one rank leaves them out (`masked_attention`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

from vllm_omni_like.models.z_image.sequence import project_out, rotated_qkv
from vllm_omni_like.models.zeroed_keys import has_lse_kernel, zeroed_keys_attention
from vllm_omni_like.parallel.ulysses import SequenceShards, UlyssesProcessor

Args = tuple[Any, ...]
_FREQS, _NOISE = 2, 4  # a main layer's positional arguments: its RoPE table, noise mask


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    """Attention (B, S, H, D) over the keys `keep` (B, S) marks True: on CUDA in half precision
    in one unmasked call (`zeroed_keys_attention`, as one rank's fast attention), elsewhere
    masked SDPA (as diffusers' processor)."""
    if q.is_cuda and has_lse_kernel(q):
        return zeroed_keys_attention(q, k, v, keep)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
    return out.transpose(1, 2)


class UlyssesZImageAttention(UlyssesProcessor, ZSingleStreamAttnProcessor):  # type: ignore[misc]  # untyped
    """A main layer's self-attention (projections, QK norms, RoPE and the output projection as
    diffusers' processor has them) over every rank's share of the unified sequence."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        freqs_cis: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None or (
            attention_mask is not None and attention_mask.ndim != 2
        ):
            raise ValueError("a sequence-parallel Z-Image attention takes a (rows, keys) mask")
        q, k, v = rotated_qkv(attn, hidden_states, freqs_cis)
        attend = None
        if attention_mask is not None:
            attend = functools.partial(masked_attention, keep=attention_mask.bool())
        return project_out(attn, self.exchange(q, k.to(q.dtype), v, attend=attend))


def split_z_image(model: Any, shards: SequenceShards) -> None:
    """Make `model` (a ZImageTransformer2DModel, not yet compiled) hold this rank's share of its
    unified sequence in its main layers and attend over every rank's (hooks and processors:
    its weights untouched). (Omni mode's per-token noise mask, not served, is cut with it.)"""

    def share(first: bool, module: Any, args: Args) -> Args:
        out = list(args)
        if first:
            out[0] = shards.shard(args[0], 1)
        for i in (_FREQS, _NOISE):
            if len(out) > i and out[i] is not None:
                out[i] = shards.shard(out[i], 1, record=False)
        return tuple(out)

    for i, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(functools.partial(share, i == 0))
        layer.attention.set_processor(UlyssesZImageAttention(shards))
    model.layers[-1].register_forward_hook(lambda m, a, out: shards.gather(out, 1))
