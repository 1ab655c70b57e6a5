"""Ulysses attention (parallel/ulysses.py) on 2 and 4 gloo ranks against one rank's attention
over the whole sequence, in float32: sequences that do not divide by N (one shorter than N),
heads that do not (fewer than N included), tokens every rank holds whole (a text's), batches of
two; compiled (dynamo, no graph break) as well as eager."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.parallel.gloo_ranks import run_ranks
from vllm_omni_like.parallel.ulysses import SequenceShards, pad_dim, padded

# multi-process, ~10-30 s each: drills (tests/stages/test_sequence_parallel.py's default test runs
# this attention at 2 ranks within 1e-5 of one rank, through real workers)
pytestmark = [pytest.mark.slow, pytest.mark.drill]
TOLERANCE = 1e-5
# (rows, replicated tokens, split tokens, heads, head dim)
CASES = [
    (2, 0, 13, 4, 8),  # tokens not a multiple of 2 or 4
    (1, 5, 11, 3, 8),  # a text of 5 tokens; 3 heads (padded to 4)
    (2, 7, 16, 2, 4),  # 2 heads over 4 ranks: two ranks hold padding heads only
    (1, 0, 3, 6, 8),  # fewer tokens than 4 ranks: the last holds padding only
]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One rank's attention over the whole sequence (B, L, H, D), as diffusers' SDPA does."""
    out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)))
    return out.transpose(1, 2)


def _case(shards: SequenceShards, case: tuple[int, ...], seed: int, attend) -> float:
    """The largest difference between this rank's rows of the split attention and the rows of
    one rank's (every rank draws the same tensors)."""
    rows, text, tokens, heads, dim = case
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(rows, text + tokens, heads, dim, generator=gen) for _ in range(3))
    want = reference(q, k, v)

    def split(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[:, :text], shards.shard(x[:, text:], 1)], dim=1)

    got = attend(split(q), split(k), split(v), text)
    per = shards.local(tokens)
    mine = want[:, text:][:, shards.rank * per : (shards.rank + 1) * per]
    real = mine.shape[1]  # (the last ranks' shares may end in padding)
    diff = (got[:, text : text + real] - mine).abs().max().item() if real else 0.0
    return max(diff, (got[:, :text] - want[:, :text]).abs().max().item() if text else 0.0)


def _attention_on_ranks(rank: int, size: int, compiled: bool) -> list[float]:
    shards = SequenceShards(rank, size, dist.group.WORLD)
    attend = shards.attention
    if compiled:
        attend = torch.compile(shards.attention, backend="eager", fullgraph=True, dynamic=False)
    return [_case(shards, case, seed, attend) for seed, case in enumerate(CASES)]


def _shard_and_gather(rank: int, size: int) -> bool:
    shards = SequenceShards(rank, size, dist.group.WORLD)
    x = torch.arange(2 * 13 * 3, dtype=torch.float32).reshape(2, 13, 3)
    mine = shards.shard(x, 1)
    per = shards.local(13)
    expect = pad_dim(x, 1, padded(13, size))[:, rank * per : (rank + 1) * per]
    return torch.equal(mine, expect) and torch.equal(shards.gather(mine, 1), x)


def _eager_on_ranks(rank: int, size: int) -> tuple[list[float], bool]:
    return _attention_on_ranks(rank, size, False), _shard_and_gather(rank, size)


@pytest.mark.parametrize("size", [2, 4])
def test_split_attention_equals_one_ranks_and_a_sequence_gathers_back(size):
    """Each case within 1e-5 of one rank's; a sequence sharded (padded: 13 tokens) then
    gathered is itself."""
    answers = run_ranks(_eager_on_ranks, size)
    assert max(max(diffs) for diffs, _ in answers) <= TOLERANCE, answers
    assert all(gathered for _, gathered in answers)


def _whole_forward_compiled(rank: int, size: int) -> float:
    """Shard, attend, gather in one compiled graph (fullgraph: a break raises)."""
    shards = SequenceShards(rank, size, dist.group.WORLD)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 13, 4, 8, generator=gen)

    def forward(x: torch.Tensor) -> torch.Tensor:
        mine = shards.shard(x, 1)
        return shards.gather(shards.attention(mine, mine, mine), 1)

    got = torch.compile(forward, backend="eager", fullgraph=True, dynamic=False)(x)
    return (got - reference(x, x, x)).abs().max().item()


def test_compiled_without_graph_breaks_equals_one_ranks():
    """Every case compiled (fullgraph, static shapes as a stage compiles) on 2 ranks, and a
    whole forward over a one-rank group."""
    diffs = run_ranks(_attention_on_ranks, 2, True)
    assert max(max(d) for d in diffs) <= TOLERANCE, diffs
    assert max(run_ranks(_whole_forward_compiled, 1)) <= TOLERANCE


def test_a_whole_forward_compiled_on_4_ranks_equals_one_ranks():
    assert max(run_ranks(_whole_forward_compiled, 4)) <= TOLERANCE
