"""Ulysses sequence parallelism: each of a replica's N ranks holds 1/N of a sequence's tokens,
and attention trades heads for tokens with one all-to-all, so that each rank attends over every
token for 1/N of the heads, then trades them back.

- A sequence is cut into N contiguous shares after zero-padding it to a multiple of N
  (`shard`); `gather` puts the shares back together and drops the padding. Padded tokens run
  through the per-token layers like any other (zeros stay finite through norms and MLPs) and
  never reach the softmax: after the exchange every rank holds the whole padded sequence, and
  the padded queries, keys and values are cut off there - the same as masking the keys, without
  a mask that would push SDPA off its fastest kernels.
- Tokens every rank holds whole (`replicated`: a text's, in a joint attention) are not
  exchanged: each rank takes its own heads of them, and their outputs are gathered head-wise.
- A mask of keys (a text padded to its bucket) is the same on every rank once exchanged: each
  rank attends over every token for its heads, so a family passes its masked attention
  (`attend`) and nothing else changes.
- Heads that do not divide by N are padded with zero heads up to the next multiple (a zero
  query over zero keys and values attends to zeros): each rank gets ceil(H/N) heads, as many
  as the busiest rank of an uneven split would, so the padding costs bytes, not time.
- The exchanges are torch.distributed's functional collectives, which torch.compile traces
  into the model's graph (no graph break); q, k and v travel in one all-to-all.

What the sequence is (which tokens, where in a model) is the family adapter's to say
(models/<family>/sequence_parallel.py); parallel/sequence_parallel.py runs the ranks' forwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed._functional_collectives as fc
import torch.nn.functional as F

# `all_gather_single` is torch 2.13's name; 2.11 (the GPU machines' torch) has only
# `all_gather_tensor`, the same collective with the same arguments, deprecated in 2.13.
gather_single: Callable[..., torch.Tensor] = getattr(fc, "all_gather_single", None) or (
    fc.all_gather_tensor
)


def padded(length: int, parts: int) -> int:
    """`length` rounded up to a multiple of `parts`."""
    return -(-length // parts) * parts


def pad_dim(x: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """`x` zero-padded at the end of `dim` to `length` (as it is if as long)."""
    extra = length - x.shape[dim]
    if extra <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unmasked attention in the (B, L, H, D) layout."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


class SequenceShards:
    """One rank's side of a replica's N ranks splitting sequences: its share of a sequence, the
    whole sequence back from every rank's share, and attention over the whole of it.

    `length` is the real token count of the sequence being split, set by the `shard` of the
    current forward (the padding is cut off against it); one forward splits one sequence."""

    def __init__(self, rank: int, size: int, group: Any) -> None:
        self.rank = rank
        self.size = size
        self.group = group  # the ranks' process group (the functional collectives')
        self.length = 0

    def local(self, length: int) -> int:
        """The tokens each rank holds of a sequence of `length` (padding included)."""
        return padded(length, self.size) // self.size

    def shard(self, x: torch.Tensor, dim: int, record: bool = True) -> torch.Tensor:
        """This rank's contiguous share of `x` along `dim`, once zero-padded to a multiple of N;
        `record`: `x` is the sequence being split (its length is kept for `gather` and
        `attention`)."""
        length = x.shape[dim]
        if record:
            self.length = length
        per = self.local(length)
        return pad_dim(x, dim, per * self.size).narrow(dim, self.rank * per, per)

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole sequence (`length` tokens along `dim`) from every rank's share `x`."""
        if self.size == 1:  # (one rank holds the whole sequence: no copy, no collective)
            return x
        first = x.movedim(dim, 0).contiguous()
        whole = gather_single(first, 0, self.group)
        return whole.narrow(0, 0, self.length).movedim(0, dim)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        replicated: int = 0,
        attend: Attend | None = None,
    ) -> torch.Tensor:
        """softmax(q k^T / sqrt(D)) v over the whole sequence, in diffusers' processors'
        (B, L, H, D) layout: L = `replicated` tokens every rank holds whole (first), then this
        rank's share of the split sequence. Returns this rank's L tokens, every head.
        `attend`: the attention each rank runs over [replicated, the whole split sequence] for
        its heads, once exchanged (a family's masked one: a padded text's keys left out);
        unmasked SDPA by default.

        Over a one-rank group nothing is exchanged: every head and token is already here, and
        the exchange's copies (the layout the collective takes, the collective itself, and
        back) cost a Wan2.1-1.3B step 3.7% on an H100 (bench/README.md, #60)."""
        if self.size == 1:
            return (attend or sdpa)(q, k, v)
        heads = q.shape[2]
        per = -(-heads // self.size)  # each rank's heads (zero heads pad the last ones)
        qkv = pad_dim(torch.cat([q, k, v]), 2, per * self.size)
        text = qkv[:, :replicated, self.rank * per : (self.rank + 1) * per]
        image = self._to_heads(qkv[:, replicated:])
        whole = self.local(self.length) * self.size
        joint = torch.cat([text, image[:, : self.length]], dim=1)
        out = (attend or sdpa)(*joint.chunk(3))
        image_out = self._to_tokens(pad_dim(out[:, replicated:], 1, whole))
        if replicated:
            text_out = self._gather_heads(out[:, :replicated])
            image_out = torch.cat([text_out, image_out], dim=1)
        return image_out[:, :, :heads]

    def _to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, s, N*h, D), this rank's s tokens -> (B, N*s, h, D), every token of its heads."""
        b, s, hn, d = x.shape
        n = self.size
        sent = x.reshape(b, s, n, hn // n, d).permute(2, 0, 1, 3, 4).contiguous()
        got = fc.all_to_all_single(sent, None, None, self.group)
        return got.reshape(n, b, s, hn // n, d).permute(1, 0, 2, 3, 4).reshape(b, n * s, -1, d)

    def _to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """`_to_heads` undone: (B, N*s, h, D) -> (B, s, N*h, D)."""
        b, ns, h, d = x.shape
        n = self.size
        sent = x.reshape(b, n, ns // n, h, d).permute(1, 0, 2, 3, 4).contiguous()
        got = fc.all_to_all_single(sent, None, None, self.group)
        return got.reshape(n, b, ns // n, h, d).permute(1, 2, 0, 3, 4).reshape(b, ns // n, -1, d)

    def _gather_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, h, D), this rank's heads of tokens every rank holds -> (B, T, N*h, D)."""
        whole = gather_single(x.movedim(2, 0).contiguous(), 0, self.group)
        return whole.movedim(0, 2)


class UlyssesProcessor:
    """What every family's sequence-parallel attention processor shares (its own is in
    models/<family>/sequence_parallel.py): it is built over this rank's `SequenceShards` and
    attends through them. A family's processor mixes it in before the diffusers processor it
    replaces (`class X(UlyssesProcessor, TheirProcessor)`, so the module still sees the type it
    expects) and keeps its own `__call__`: diffusers passes a processor only the arguments its
    `__call__` names, and which tokens are whole on every rank is the family's to say."""

    def __init__(self, shards: SequenceShards) -> None:
        super().__init__()
        self.shards = shards

    def exchange(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        replicated: int = 0,
        attend: Attend | None = None,
    ) -> torch.Tensor:
        """`SequenceShards.attention` of this rank's (B, L, H, D) queries, keys and values, the
        heads joined again (B, L, H*D), in the queries' dtype."""
        out = self.shards.attention(q, k, v, replicated=replicated, attend=attend)
        return out.flatten(2, 3).to(q.dtype)
