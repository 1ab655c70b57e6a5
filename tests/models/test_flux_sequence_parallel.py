"""A FLUX.1 transformer split over 2 and 4 gloo ranks (models/flux/sequence_parallel.py)
against the same transformer on one rank, in float32: FLUX.1-dev's shape (a guidance
embedding), 2 heads (over 4 ranks: two hold padding heads only), 15 image tokens (divisible by
neither), a text of 24 T5 tokens every rank holds whole, two rows at different timesteps."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.models.tiny_mmdit import tiny_flux_path
from tests.parallel.gloo_ranks import run_ranks
from vllm_omni_like.models.flux.sequence_parallel import split_flux
from vllm_omni_like.parallel.ulysses import SequenceShards

pytestmark = pytest.mark.slow
TOLERANCE = 1e-5


def _forward_split(rank: int, size: int, path: str) -> tuple[float, list[int]]:
    """The largest difference between the split forward and one rank's, and the image tokens
    each double-stream block took on this rank."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(path, subfolder="transformer").float().eval()
    gen = torch.Generator().manual_seed(1)
    h, w = 3, 5  # packed: 15 tokens
    ids = FluxPipeline._prepare_latent_image_ids(1, h, w, torch.device("cpu"), torch.float32)
    kwargs = {
        "hidden_states": torch.randn(2, h * w, model.config.in_channels, generator=gen),
        "encoder_hidden_states": torch.randn(
            2, 24, model.config.joint_attention_dim, generator=gen
        ),
        "pooled_projections": torch.randn(2, model.config.pooled_projection_dim, generator=gen),
        "timestep": torch.tensor([0.9, 0.3]),
        "guidance": torch.tensor([3.5, 5.0]),
        "txt_ids": torch.zeros(24, 3),
        "img_ids": ids,
        "return_dict": False,
    }
    with torch.inference_mode():
        want = model(**kwargs)[0]
        split_flux(model, SequenceShards(rank, size, dist.group.WORLD))
        seen: list[int] = []
        for block in model.transformer_blocks:
            block.register_forward_pre_hook(
                lambda m, args, kw: seen.append(kw["hidden_states"].shape[1]), with_kwargs=True
            )
        got = model(**kwargs)[0]
    return (got - want).abs().max().item(), seen


@pytest.mark.parametrize("size", [2, 4])
def test_a_split_forward_equals_one_ranks(size):
    answers = run_ranks(_forward_split, size, tiny_flux_path())
    for diff, seen in answers:
        assert diff <= TOLERANCE and seen == [-(-15 // size)], answers
