"""A Wan transformer split over 2 and 4 gloo ranks (models/wan/sequence_parallel.py) against
the same transformer on one rank, in float32: Wan2.1's (the embedded tiny-video model's) and
Wan2.2-TI2V's (a timestep per token, its first frame's at 0), a token count that divides by
neither, a batch of two rows at different timesteps."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.models.tiny_wan22 import tiny_wan22_ti2v_path
from tests.parallel.gloo_ranks import diffusers_ulysses, run_ranks
from vllm_omni_like.models.tiny import ensure_tiny_model
from vllm_omni_like.models.wan.sequence_parallel import split_wan
from vllm_omni_like.parallel.ulysses import SequenceShards

pytestmark = [pytest.mark.slow, pytest.mark.drill]  # (multi-process: 20-45 s each)
TOLERANCE = 1e-5


def _forward_split(
    rank: int, size: int, path: str, per_token: bool, compiled: bool = False
) -> tuple[float, list]:
    """The largest difference between the split forward and one rank's (every rank: the
    whole output, gathered), and the tokens each block took on this rank; `compiled`: the
    split model compiled whole (dynamo's eager backend, fullgraph: a graph break raises)."""
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel.from_pretrained(path, subfolder="transformer").float().eval()
    channels = model.config.in_channels
    gen = torch.Generator().manual_seed(1)
    latents = torch.randn(2, channels, 3, 10, 6, generator=gen)  # 3 x 5 x 3 = 45 tokens
    text = torch.randn(2, 7, model.config.text_dim, generator=gen)
    timestep = torch.tensor([900.0, 250.0])
    if per_token:
        timestep = timestep[:, None].repeat(1, 45)
        timestep[:, :15] = 0.0  # the first frame's tokens (image to video)
    kwargs = {"hidden_states": latents, "timestep": timestep, "encoder_hidden_states": text}
    with torch.inference_mode():
        want = model(**kwargs, return_dict=False)[0]
        split_wan(model, SequenceShards(rank, size, dist.group.WORLD))
        seen: list[int] = []
        for block in model.blocks:
            block.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
        if compiled:
            model = torch.compile(model, backend="eager", fullgraph=True, dynamic=False)
        got = model(**kwargs, return_dict=False)[0]
    return (got - want).abs().max().item(), seen


def _against_diffusers(rank: int, size: int, path: str, per_token: bool) -> tuple[float, float]:
    """At 48 tokens (3 x 4 x 4: a multiple of N, as diffusers' Ulysses asks): the largest
    difference between our split forward and diffusers' own context-parallel one, and between
    theirs and one rank's."""
    from diffusers import WanTransformer3DModel

    ours, theirs = (
        WanTransformer3DModel.from_pretrained(path, subfolder="transformer").float().eval()
        for _ in range(2)
    )
    gen = torch.Generator().manual_seed(3)
    timestep = torch.tensor([700.0, 100.0])
    if per_token:
        timestep = timestep[:, None].repeat(1, 48)
    kwargs = {
        "hidden_states": torch.randn(2, ours.config.in_channels, 3, 8, 8, generator=gen),
        "timestep": timestep,
        "encoder_hidden_states": torch.randn(2, 7, ours.config.text_dim, generator=gen),
        "return_dict": False,
    }
    with torch.inference_mode():
        want = ours(**kwargs)[0]
        split_wan(ours, SequenceShards(rank, size, dist.group.WORLD))
        diffusers_ulysses(theirs, size)
        got, reference = ours(**kwargs)[0], theirs(**kwargs)[0]
    return (got - reference).abs().max().item(), (reference - want).abs().max().item()


def _both(rank: int, size: int, wan21: str, ti2v: str) -> tuple[list, list]:
    ours = [
        _forward_split(rank, size, wan21, False),
        _forward_split(rank, size, ti2v, True),
        _forward_split(rank, size, ti2v, True, compiled=True),
    ]
    theirs = [
        _against_diffusers(rank, size, wan21, False),
        _against_diffusers(rank, size, ti2v, True),
    ]
    return ours, theirs


@pytest.mark.parametrize("size", [2, 4])
def test_a_split_forward_equals_one_ranks_and_diffusers_context_parallel(size):
    """Each block of each rank took its share of the 45 tokens (23 or 12, padding included),
    eager and compiled whole (no graph break); where diffusers' context parallelism runs (48
    tokens), ours equals it within 1e-5."""
    answers = run_ranks(_both, size, ensure_tiny_model("tiny-video"), tiny_wan22_ti2v_path())
    share = -(-45 // size)
    for ours, theirs in answers:
        for diff, seen in ours:
            assert diff <= TOLERANCE and seen == [share] * 4, ours
        assert max(max(pair) for pair in theirs) <= TOLERANCE, theirs
