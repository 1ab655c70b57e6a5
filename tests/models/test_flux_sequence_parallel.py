"""A FLUX.1 transformer split over 2 and 4 gloo ranks (models/flux/sequence_parallel.py)
against the same transformer on one rank, in float32: FLUX.1-dev's shape (a guidance
embedding), 2 heads (over 4 ranks: two hold padding heads only), 15 image tokens (divisible by
neither), a text of 24 T5 tokens every rank holds whole, two rows at different timesteps; and
on 2 ranks against diffusers' own context parallelism."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.models.tiny_mmdit import tiny_flux_path
from tests.parallel.gloo_ranks import diffusers_ulysses, run_ranks
from vllm_omni_like.models.flux.sequence_parallel import split_flux
from vllm_omni_like.parallel.ulysses import SequenceShards

pytestmark = [pytest.mark.slow, pytest.mark.drill]  # (multi-process: 20-45 s each)
TOLERANCE = 1e-5


def _inputs(model, h: int, w: int, seed: int) -> dict:
    from diffusers import FluxPipeline

    gen = torch.Generator().manual_seed(seed)
    ids = FluxPipeline._prepare_latent_image_ids(1, h, w, torch.device("cpu"), torch.float32)
    config = model.config
    return {
        "hidden_states": torch.randn(2, h * w, config.in_channels, generator=gen),
        "encoder_hidden_states": torch.randn(2, 24, config.joint_attention_dim, generator=gen),
        "pooled_projections": torch.randn(2, config.pooled_projection_dim, generator=gen),
        "timestep": torch.tensor([0.9, 0.3]),
        "guidance": torch.tensor([3.5, 5.0]),
        "txt_ids": torch.zeros(24, 3),
        "img_ids": ids,
        "return_dict": False,
    }


def _forward_split(rank: int, size: int, path: str) -> tuple[float, list[int], float]:
    """The largest difference between the split forward and one rank's at 15 image tokens,
    and the image tokens each double-stream block took on this rank; on 2 ranks, at 16 tokens
    (diffusers splits the text too: 24 tokens, and asks a multiple of N), the largest
    difference between ours and diffusers' own context-parallel forward."""
    from diffusers import FluxTransformer2DModel

    def load():
        return FluxTransformer2DModel.from_pretrained(path, subfolder="transformer").float().eval()

    model, theirs = load(), load()
    kwargs, even = _inputs(model, 3, 5, seed=1), _inputs(model, 4, 4, seed=2)
    with torch.inference_mode():
        want = model(**kwargs)[0]
        split_flux(model, SequenceShards(rank, size, dist.group.WORLD))
        seen: list[int] = []
        for block in model.transformer_blocks:
            block.register_forward_pre_hook(
                lambda m, args, kw: seen.append(kw["hidden_states"].shape[1]), with_kwargs=True
            )
        got = model(**kwargs)[0]
        against = 0.0
        if size == 2:  # (diffusers' Ulysses splits the 2 heads: 4 ranks are too many)
            diffusers_ulysses(theirs, size)
            against = (model(**even)[0] - theirs(**even)[0]).abs().max().item()
    return (got - want).abs().max().item(), seen[:1], against


@pytest.mark.parametrize("size", [2, 4])
def test_a_split_forward_equals_one_ranks_and_diffusers_context_parallel(size):
    answers = run_ranks(_forward_split, size, tiny_flux_path())
    for diff, seen, against in answers:
        assert diff <= TOLERANCE and against <= TOLERANCE, answers
        assert seen == [-(-15 // size)], answers
