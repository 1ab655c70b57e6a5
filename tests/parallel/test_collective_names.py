"""parallel/ulysses.py's gather under the collective's two names: torch 2.13 has
`all_gather_single` (and deprecates `all_gather_tensor`); torch 2.11, the GPU machines' torch,
has only `all_gather_tensor` - the split path's first GPU run died there with an AttributeError
while CI's torch passed. Both ranks here hide the new name, as 2.11 has it, and reload the
module: it takes the old one and a sequence sharded over 2 gloo ranks gathers back whole."""

from __future__ import annotations

import importlib
import sys
import types

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from tests.parallel.gloo_ranks import run_ranks


def _without_the_new_name() -> None:
    """This spawned rank's view of the module as torch 2.11 has it (its functions keep their
    own globals: 2.13's `all_gather_tensor` calls `all_gather_single` inside)."""
    old = types.ModuleType(fc.__name__)
    old.__dict__.update({k: v for k, v in vars(fc).items() if k != "all_gather_single"})
    sys.modules[fc.__name__] = old
    torch.distributed._functional_collectives = old  # type: ignore[attr-defined]


def _gather_without_the_new_name(rank: int, size: int) -> tuple[bool, bool]:
    _without_the_new_name()
    from vllm_omni_like.parallel import ulysses

    ulysses = importlib.reload(ulysses)
    shards = ulysses.SequenceShards(rank, size, dist.group.WORLD)
    x = torch.arange(2 * 13 * 3, dtype=torch.float32).reshape(2, 13, 3)
    took_old = ulysses.gather_single is fc.all_gather_tensor
    return took_old, torch.equal(shards.gather(shards.shard(x, 1), 1), x)


def test_the_gather_runs_on_a_torch_without_all_gather_single():
    assert run_ranks(_gather_without_the_new_name, 2) == [(True, True), (True, True)]


def test_the_installed_torchs_own_name_is_taken_where_it_has_one():
    from vllm_omni_like.parallel import ulysses

    want = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor
    assert ulysses.gather_single is want
