"""A one-rank `SequenceShards` (parallel/ulysses.py) exchanges nothing: no collective is called
(they are patched to raise here, and no process group exists), the shard and the gathered
sequence are the input itself, and attention is plain SDPA's, bit for bit - the copies an
exchange makes cost a one-rank Wan2.1-1.3B step 3.7% on an H100 (#60)."""

from __future__ import annotations

import pytest
import torch

from vllm_omni_like.parallel import ulysses
from vllm_omni_like.parallel.ulysses import SequenceShards, sdpa


@pytest.fixture
def shards(monkeypatch) -> SequenceShards:
    def refuse(*_a, **_k):
        raise AssertionError("a one-rank group called a collective")

    monkeypatch.setattr(ulysses.fc, "all_to_all_single", refuse)
    monkeypatch.setattr(ulysses, "gather_single", refuse)
    return SequenceShards(0, 1, group=None)


def test_the_shard_and_the_gather_are_the_sequence_itself(shards):
    x = torch.randn(2, 13, 3)
    mine = shards.shard(x, 1)
    assert mine.data_ptr() == x.data_ptr() and mine.shape == x.shape
    assert shards.gather(mine, 1) is mine


@pytest.mark.parametrize("replicated", [0, 5])
def test_attention_is_sdpas_bit_for_bit(shards, replicated):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, replicated + 11, 3, 8, generator=gen) for _ in range(3))
    shards.shard(q[:, replicated:], 1)  # (the split sequence's length, as a forward records it)
    got = shards.attention(q, k, v, replicated=replicated)
    assert torch.equal(got, sdpa(q, k, v))
    masked = shards.attention(q, k, v, replicated=replicated, attend=lambda a, b, c: a + b + c)
    assert torch.equal(masked, q + k + v)  # (a family's own attention, given every token)
