"""A Z-Image transformer split over 2, 3 and 4 gloo ranks (models/z_image/sequence_parallel.py)
against the same transformer on one rank, in float32: the tiny Z-Image's 2 heads, two rows at
different timesteps whose captions differ in length (10 and 40 tokens: the transformer pads
them to 32 and 64 with its pad token, and the unified sequences [image, caption] of 32 + 32 and
32 + 64 tokens to the longer one, with a mask of keys), as diffusers runs it and as our loop
pads it further (models/z_image/sequence.py: its caption bucket, a mask). Z-Image's sequences
are multiples of 32 tokens: 3 ranks divide neither length, 2 and 4 both.

On 2 ranks, against diffusers' own context parallelism: Z-Image ships no plan for it, but its
attention goes through diffusers' dispatcher, so a plan given here (the unified sequence, its
RoPE table and mask split as each main layer takes them, the last one's output gathered) runs
diffusers' Ulysses on it: the independent reference."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.models.tiny_z_image import tiny_z_image_path
from tests.parallel.gloo_ranks import diffusers_ulysses, run_ranks
from vllm_omni_like.models.z_image.sequence import pad_sequences_to_buckets
from vllm_omni_like.models.z_image.sequence_parallel import split_z_image
from vllm_omni_like.parallel.ulysses import SequenceShards

# (multi-process: 30-90 s each on a loaded 2-core machine; 4 ranks near the default 120 s bound)
pytestmark = [pytest.mark.slow, pytest.mark.drill, pytest.mark.timeout(600)]
TOLERANCE = 1e-5


def _load(path: str):
    from diffusers import ZImageTransformer2DModel

    return ZImageTransformer2DModel.from_pretrained(path, subfolder="transformer").float().eval()


def _inputs(model, captions: tuple[int, int], seed: int) -> dict:
    """Two rows of 8 x 8 latents (16 image tokens, padded to 32) and captions of `captions`
    tokens."""
    gen = torch.Generator().manual_seed(seed)
    config = model.config
    return {
        "x": [torch.randn(config.in_channels, 1, 8, 8, generator=gen) for _ in range(2)],
        "cap_feats": [torch.randn(n, config.cap_feat_dim, generator=gen) for n in captions],
        "t": torch.tensor([0.9, 0.3]),
        "return_dict": False,
    }


def _difference(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max((g - w).abs().max().item() for g, w in zip(got, want, strict=True))


def _split_case(rank: int, size: int, path: str, buckets: bool) -> tuple[float, list[int]]:
    """The largest difference between the split forward and one rank's, and the tokens the
    first main layer took on this rank; `buckets`: our loop's padding to caption buckets."""
    model = _load(path)
    if buckets:
        pad_sequences_to_buckets(model)
    kwargs = _inputs(model, (10, 40), seed=1)
    with torch.inference_mode():
        want = model(**kwargs)[0]
        split_z_image(model, SequenceShards(rank, size, dist.group.WORLD))
        seen: list[int] = []
        model.layers[0].register_forward_hook(lambda m, args, out: seen.append(out.shape[1]))
        got = model(**kwargs)[0]
    return _difference(got, want), seen


def _plan() -> dict:
    """diffusers' context-parallel plan for Z-Image's two main layers (the tiny model's): the
    unified sequence split as the first takes it, its mask and RoPE table as each does, the
    last one's output gathered."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    def split(dims: int) -> ContextParallelInput:
        return ContextParallelInput(split_dim=1, expected_dims=dims, split_output=False)

    return {
        "layers.0": {"x": split(3)},
        "layers.*": {"attn_mask": split(2), "freqs_cis": split(3)},
        "layers.1": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


def _against_diffusers(rank: int, size: int, path: str) -> tuple[float, float]:
    """Ours against diffusers' context-parallel forward, and theirs against one rank's."""
    ours, theirs = _load(path), _load(path)
    kwargs = _inputs(ours, (10, 40), seed=2)
    with torch.inference_mode():
        want = ours(**kwargs)[0]
        split_z_image(ours, SequenceShards(rank, size, dist.group.WORLD))
        diffusers_ulysses(theirs, size, _plan())
        got, reference = ours(**kwargs)[0], theirs(**kwargs)[0]
    return _difference(got, reference), _difference(reference, want)


def _forward_split(rank: int, size: int, path: str) -> tuple[list, tuple[float, float]]:
    ours = [_split_case(rank, size, path, buckets) for buckets in (False, True)]
    against = _against_diffusers(rank, size, path) if size == 2 else (0.0, 0.0)
    return ours, against


@pytest.mark.parametrize("size", [2, 3, 4])
def test_a_split_forward_equals_one_ranks_and_diffusers_context_parallel(size):
    """Each case within 1e-5 of one rank's, the first main layer of each rank taking its share
    of the 96-token unified sequence (padding included); on 2 ranks within 1e-5 of diffusers'
    own, which is itself one rank's."""
    answers = run_ranks(_forward_split, size, tiny_z_image_path(), timeout=300)
    for ours, against in answers:
        assert [seen for _, seen in ours] == [[-(-96 // size)]] * 2, answers
        assert max(diff for diff, _ in ours) <= TOLERANCE, answers
        assert max(against) <= TOLERANCE, answers
