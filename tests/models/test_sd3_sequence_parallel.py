"""An SD3 transformer split over 2 and 4 gloo ranks (models/sd3/sequence_parallel.py) against the
same transformer on one rank, in float32: SD3.5-medium's shape (MMDiT-X: a second, image-only
attention) and SD3.5-large's (plain joint blocks), both with RMS-normed queries and keys, the
large one's also with fused projections; 4 heads (3 ranks would pad), 15 image tokens (6 x 10
latents in 2 x 2 patches: divisible by neither), a text of 12 tokens every rank holds whole, two
rows at different timesteps.

No comparison with diffusers' own context parallelism here: it cannot split SD3 (diffusers
0.42). SD3Transformer2DModel has no context-parallel plan, and its attention processor
(JointAttnProcessor2_0) calls torch's SDPA itself rather than diffusers' dispatcher, where
Ulysses' exchange lives: given a plan, each rank attends over its own tokens only.
`test_diffusers_context_parallelism_cannot_split_sd3` shows both."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.models.tiny_mmdit import tiny_sd3_path
from tests.parallel.gloo_ranks import diffusers_ulysses, run_ranks
from vllm_omni_like.models.sd3.sequence_parallel import split_sd3
from vllm_omni_like.parallel.ulysses import SequenceShards

# (multi-process: 30-90 s each on a loaded 2-core machine; 4 ranks near the default 120 s bound)
pytestmark = [pytest.mark.slow, pytest.mark.drill, pytest.mark.timeout(600)]
TOLERANCE = 1e-5


def _load(path: str):
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel.from_pretrained(path, subfolder="transformer").float().eval()


def _inputs(model, h: int, w: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    config = model.config
    return {
        "hidden_states": torch.randn(2, config.in_channels, h, w, generator=gen),
        "encoder_hidden_states": torch.randn(2, 12, config.joint_attention_dim, generator=gen),
        "pooled_projections": torch.randn(2, config.pooled_projection_dim, generator=gen),
        "timestep": torch.tensor([900.0, 250.0]),
        "return_dict": False,
    }


def _split_case(rank: int, size: int, path: str, fused: bool) -> tuple[float, list[int]]:
    """The largest difference between the split forward and one rank's (unfused), and the
    image tokens the first block took on this rank; `fused`: the split model's projections
    fused first (one GEMM each stream, as `fuse_qkv_projections` makes them)."""
    from diffusers.models.attention_processor import Attention

    model = _load(path)
    kwargs = _inputs(model, 6, 10, seed=1)
    with torch.inference_mode():
        want = model(**kwargs)[0]
        if fused:
            for module in model.modules():
                if isinstance(module, Attention):
                    module.fuse_projections(fuse=True)
        split_sd3(model, SequenceShards(rank, size, dist.group.WORLD))
        seen: list[int] = []
        model.transformer_blocks[0].register_forward_pre_hook(
            lambda m, args, kw: seen.append(kw["hidden_states"].shape[1]), with_kwargs=True
        )
        got = model(**kwargs)[0]
    return (got - want).abs().max().item(), seen


def _forward_split(rank: int, size: int, medium: str, large: str) -> list:
    return [
        _split_case(rank, size, medium, fused=False),
        _split_case(rank, size, large, fused=False),
        _split_case(rank, size, large, fused=True),
    ]


@pytest.mark.parametrize("size", [2, 4])
def test_a_split_forward_equals_one_ranks(size):
    answers = run_ranks(
        _forward_split, size, tiny_sd3_path(True), tiny_sd3_path(False), timeout=300
    )
    for cases in answers:
        assert [seen for _, seen in cases] == [[-(-15 // size)]] * 3, answers
        assert max(diff for diff, _ in cases) <= TOLERANCE, answers


def _diffusers_split(rank: int, size: int, path: str) -> tuple[str, float]:
    """diffusers' context parallelism on SD3: refused without a plan; with one (the image
    and text tokens split as they enter the blocks, the output gathered, as its other models'
    plans do) its attention stays each rank's own: the largest difference from one rank's."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    model = _load(path)
    kwargs = _inputs(model, 8, 8, seed=2)  # (16 image tokens and 12 text: multiples of 2)
    with pytest.raises(ValueError) as refused:
        diffusers_ulysses(model, size)
    model = _load(path)
    split = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)
    plan = {
        "transformer_blocks.0": {"hidden_states": split, "encoder_hidden_states": split},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }
    with torch.inference_mode():
        want = model(**kwargs)[0]
        diffusers_ulysses(model, size, plan)
        return str(refused.value), (model(**kwargs)[0] - want).abs().max().item()


def test_diffusers_context_parallelism_cannot_split_sd3():
    """What fails, on 2 ranks: `enable_parallelism` asks for a plan SD3 does not have, and
    with one the output is not one rank's (its attention never exchanges the tokens)."""
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    assert not hasattr(JointAttnProcessor2_0(), "_parallel_config")  # (no dispatcher: no CP)
    for refused, diff in run_ranks(_diffusers_split, 2, tiny_sd3_path(False)):
        assert "`cp_plan` must be provided" in refused
        assert diff > 100 * TOLERANCE, diff
