"""The Wan VAE's decode over a sequence-parallel replica's ranks, patch-parallel
(parallel/patch_decode.py): each rank decodes a band of the latent rows and the bands are
gathered, the same pixels as one rank's decode.

Where the bands are cut: after the decoder's middle block. Its attention spans a whole frame,
so `conv_in` and the middle block run whole on every rank (at the latents' resolution: a small
share of the decode); the up blocks and the head - 3x3 convolutions, nearest upsampling,
norms over channels - then run on the band and its halo only, each rank's causal caches (one
latent frame at a time, as the VAE decodes) holding its window's rows. The halo, in latent rows:
each up block's residual blocks' two 3x3 convolutions a block, at that block's scale, its
upsampler's convolution at the next, and `conv_out`'s at the last, summed and rounded up.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from diffusers.models.autoencoders.vae import DecoderOutput

from vllm_omni_like.parallel.patch_decode import Bands, Window


def decode_halo(num_res_blocks: int, up_blocks: int) -> int:
    """Latent rows a Wan decoder's output row reaches beyond its own, past the middle block."""
    reach = 0.0
    for level in range(up_blocks):
        reach += 2 * (num_res_blocks + 1) * 0.5**level  # its residual blocks' 3x3 convolutions
        if level < up_blocks - 1:
            reach += 0.5 ** (level + 1)  # the upsampler's 3x3 convolution, at the next scale
    return math.ceil(reach + 0.5 ** (up_blocks - 1))  # conv_out


def split_wan_decode(vae: Any, bands: Bands, halo: int | None = None) -> Callable[..., Any]:
    """Hooks that cut `vae`'s decoder to this rank's band while the returned decode runs (the
    decode every rank calls together, `vae.decode`'s arguments); `halo`: the config's."""
    if halo is None:
        halo = decode_halo(vae.config.num_res_blocks, len(vae.config.dim_mult))
    decoder = vae.decoder
    now: list[Window] = []  # the window of the decode running (none: the decoder runs whole)

    def band_in(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        return out[..., now[0].low : now[0].high, :] if now else out

    def band_out(module: Any, args: Any, out: torch.Tensor) -> torch.Tensor:
        if not now:
            return out
        window = now[0]
        return out[..., window.kept(out.shape[-2] // (window.high - window.low)), :]

    decoder.mid_block.register_forward_hook(band_in)
    decoder.register_forward_hook(band_out)
    whole = vae.decode

    def decode(z: torch.Tensor, return_dict: bool = True) -> Any:
        if vae.use_tiling:
            raise ValueError("a patch-parallel decode does not tile")
        rows = z.shape[-2]
        now.append(bands.window(rows, halo))
        try:
            band = whole(z, return_dict=False)[0]
        finally:
            now.clear()
        pixels = bands.gather(band, -2, rows, vae.config.scale_factor_spatial)
        return DecoderOutput(sample=pixels) if return_dict else (pixels,)

    return decode
