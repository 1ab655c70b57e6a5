"""A Qwen-Image transformer split over 2 and 4 gloo ranks (models/qwen_image/sequence_parallel.py)
against the same transformer on one rank, in float32: the tiny Qwen-Image's 2 heads (over 4
ranks: two hold padding heads only), two rows at different timesteps whose texts have different
lengths (12 and 7 tokens: the second padded with a masked tail, as a text bucket pads it); a
text-to-image sequence of 15 image tokens and Qwen-Image-Edit's of 15 noise tokens then 6 of the
upload's (21: divisible by neither), the edit's also through a `zero_cond_t` transformer (a
modulation index per token); and on 2 ranks against diffusers' own context parallelism."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.models.tiny_qwen import tiny_qwen_image_path
from tests.parallel.gloo_ranks import diffusers_ulysses, run_ranks
from vllm_omni_like.models.qwen_image.sequence_parallel import split_qwen_image
from vllm_omni_like.parallel.ulysses import SequenceShards

# (multi-process: 30-90 s each on a loaded 2-core machine; 4 ranks near the default 120 s bound)
pytestmark = [pytest.mark.slow, pytest.mark.drill, pytest.mark.timeout(600)]
TOLERANCE = 1e-5
TEXT2IMG = [(1, 3, 5)]  # 15 image tokens
EDIT = [(1, 3, 5), (1, 2, 3)]  # the noise's 15, then the upload's 6


def _load(path: str, zero_cond_t: bool = False):
    """The tiny model's transformer (`zero_cond_t`: the same weights in Qwen-Image-Edit-2511's
    shape, a second timestep embedding of 0 for the upload's tokens)."""
    from diffusers import QwenImageTransformer2DModel

    kwargs = {"zero_cond_t": True} if zero_cond_t else {}
    model = QwenImageTransformer2DModel.from_pretrained(path, subfolder="transformer", **kwargs)
    return model.float().eval()


def _inputs(model, shapes: list, texts: tuple[int, int], seed: int) -> dict:
    """Two rows: images of `shapes`, texts of `texts` tokens (the shorter one's tail masked)."""
    gen = torch.Generator().manual_seed(seed)
    config = model.config
    tokens = sum(f * h * w for f, h, w in shapes)
    length = max(texts)
    mask = torch.tensor([[1] * n + [0] * (length - n) for n in texts])
    embeds = torch.randn(2, length, config.joint_attention_dim, generator=gen) * mask[..., None]
    return {
        "hidden_states": torch.randn(2, tokens, config.in_channels, generator=gen),
        "encoder_hidden_states": embeds,
        "encoder_hidden_states_mask": mask,
        "timestep": torch.tensor([0.9, 0.3]),
        "img_shapes": [shapes] * 2,
        "return_dict": False,
    }


def _split_case(rank: int, size: int, model, kwargs: dict) -> tuple[float, list[int]]:
    """The largest difference between `model` split and one rank's forward of `kwargs`, and
    the image tokens its first block took on this rank."""
    with torch.inference_mode():
        want = model(**kwargs)[0]
        split_qwen_image(model, SequenceShards(rank, size, dist.group.WORLD))
        seen: list[int] = []
        model.transformer_blocks[0].register_forward_pre_hook(
            lambda m, args, kw: seen.append(kw["hidden_states"].shape[1]), with_kwargs=True
        )
        got = model(**kwargs)[0]
    return (got - want).abs().max().item(), seen


def _against_diffusers(rank: int, size: int, path: str) -> float:
    """At 16 image tokens and texts of 12 and 6 tokens (diffusers splits the text too, mask
    and all, and asks multiples of N): ours against diffusers' context-parallel forward."""
    ours, theirs = _load(path), _load(path)
    kwargs = _inputs(ours, [(1, 4, 4)], (12, 6), seed=4)
    with torch.inference_mode():
        split_qwen_image(ours, SequenceShards(rank, size, dist.group.WORLD))
        diffusers_ulysses(theirs, size)
        return (ours(**kwargs)[0] - theirs(**kwargs)[0]).abs().max().item()


def _forward_split(rank: int, size: int, path: str) -> tuple[list, float]:
    cases = [
        (_load(path), TEXT2IMG, 1),
        (_load(path), EDIT, 2),
        (_load(path, zero_cond_t=True), EDIT, 3),
    ]
    ours = [
        _split_case(rank, size, model, _inputs(model, shapes, (12, 7), seed))
        for model, shapes, seed in cases
    ]
    against = _against_diffusers(rank, size, path) if size == 2 else 0.0
    return ours, against


@pytest.mark.parametrize("size", [2, 4])
def test_a_split_forward_equals_one_ranks_and_diffusers_context_parallel(size):
    """Every case within 1e-5 of one rank's, each rank's first block taking its share (15 and
    21 tokens, padded to a multiple of N); on 2 ranks within 1e-5 of diffusers' own."""
    answers = run_ranks(_forward_split, size, tiny_qwen_image_path(), timeout=300)
    shares = [-(-15 // size), -(-21 // size), -(-21 // size)]
    for ours, against in answers:
        assert [seen for _, seen in ours] == [[share] for share in shares], answers
        assert max(diff for diff, _ in ours) <= TOLERANCE and against <= TOLERANCE, answers
