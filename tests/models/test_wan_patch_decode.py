"""The Wan VAE's patch-parallel decode (models/wan/patch_decode.py) on 2 and 4 gloo ranks against
the whole decode on one rank, in float32: the embedded tiny-video VAE (Wan2.1's kind) and
Wan2.2-TI2V's (residual, on 2x2 patches), latent rows that divide by neither (13, 41), fewer
rows than ranks (3: a rank's band is empty), two videos; each rank's decoder makes its band's
rows only; with one latent row less of halo than the convolutions reach, the bands' edges
differ."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.models.tiny_wan22 import tiny_wan22_ti2v_path
from tests.parallel.gloo_ranks import run_ranks
from vllm_omni_like.models.tiny import ensure_tiny_model
from vllm_omni_like.models.wan.patch_decode import decode_halo, split_wan_decode
from vllm_omni_like.parallel.patch_decode import Bands

pytestmark = pytest.mark.slow
TOLERANCE = 1e-5
ROWS = (13, 3, 41)


def _decodes(rank: int, size: int, path: str) -> tuple[list[float], float, list[int]]:
    """The largest difference between the patch-parallel decode and the whole one, for each
    of `ROWS`; at 41 rows, with one row less of halo; the rows this rank's decoder made."""
    from diffusers import AutoencoderKLWan

    def load():
        return AutoencoderKLWan.from_pretrained(path, subfolder="vae").float().eval()

    vae = load()
    gen = torch.Generator().manual_seed(2)
    cases = [torch.randn(2, vae.config.z_dim, 2, rows, 3, generator=gen) for rows in ROWS]
    halo = decode_halo(vae.config.num_res_blocks, len(vae.config.dim_mult))
    bands = Bands(rank, size, dist.group.WORLD)
    with torch.inference_mode():
        wholes = [vae.decode(z, return_dict=False)[0] for z in cases]
        short = split_wan_decode(vae, bands, halo - 1)(cases[-1], return_dict=False)[0]
        vae = load()
        split = split_wan_decode(vae, bands)
        made: list[int] = []
        vae.decoder.register_forward_hook(lambda m, a, out: made.append(out.shape[-2]))
        diffs = [
            (split(z, return_dict=False)[0] - whole).abs().max().item()
            for z, whole in zip(cases, wholes, strict=True)
        ]
    return diffs, (short - wholes[-1]).abs().max().item(), sorted(set(made))


def check(size: int, path: str, scale: int) -> None:
    """`scale`: the decoder's output rows a latent row (before a patched VAE's unpatchify)."""
    for rank, (diffs, short, made) in enumerate(run_ranks(_decodes, size, path)):
        assert max(diffs) <= TOLERANCE, (path, rank, diffs)
        assert short > TOLERANCE, (path, rank, "one row less of halo changed nothing")
        bands = [Bands(rank, size, None).window(rows, 0) for rows in ROWS]
        assert made == sorted({(b.end - b.start) * scale for b in bands}), (rank, made)


@pytest.mark.drill  # (multi-process: ~20 s; the default e2e test decodes in bands too)
def test_a_patch_parallel_decode_equals_the_whole():
    check(2, ensure_tiny_model("tiny-video"), 4)


@pytest.mark.drill  # (~1 min each: four ranks decoding on two cores)
@pytest.mark.parametrize(("size", "model"), [(2, "ti2v"), (4, "ti2v"), (4, "tiny-video")])
def test_a_patch_parallel_decode_equals_the_whole_wan22_and_4_ranks(size, model):
    path = tiny_wan22_ti2v_path() if model == "ti2v" else ensure_tiny_model(model)
    check(size, path, 4)  # (Wan2.2's VAE then unpatchifies: 8 pixel rows a latent row)


def test_the_halo_is_the_decoders_reach():
    """Wan2.1's VAE (2 residual blocks, 4 up blocks): 12.25 latent rows, rounded up; the tiny
    one's (1, 3): 8."""
    assert decode_halo(2, 4) == 13 and decode_halo(1, 3) == 8
