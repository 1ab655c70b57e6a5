"""PNG's row filters on the device, for a stage that decodes on a GPU.

PNG encoding is two passes over the pixels: each row is filtered (the one of PNG's five filters
whose output has the smallest sum of absolute signed bytes, libpng's adaptive choice), then
deflated. On the host the filter takes as long as the deflate and does not spread over cores
(its many numpy calls each take the GIL back: 8 threads filter a 1024x1024 image in 20.4 ms on
the H200 host, against 61.7 on one, where they deflate it in 14.5 against 96.6). On the device
it costs next to nothing: a stage filters the rows of an image whose consumer encodes PNG
(`StageRequest.encodes_png`) beside its pixels, and the API process only deflates them
(png.encode_png's `scanlines`). The bytes are `png.filter_rows`'s exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_omni_like.png import MIN_PIXELS


def worth_filtering(device: torch.device, height: int, width: int) -> bool:
    """Whether a stage on `device` filters images of this size: on a GPU, for the images the
    host encodes on its strip pool (smaller ones take PIL's encoder whole)."""
    return device.type == "cuda" and height * width >= MIN_PIXELS


def filter_scanlines(pixels: torch.Tensor) -> torch.Tensor:
    """(B, H, W, C) uint8 -> (B, H, 1 + W * C) uint8: each row's filter type, then its bytes
    filtered by the adaptive choice (the first of the cheapest, in PNG's filter order)."""
    rows, height, width, channels = pixels.shape
    x = pixels.reshape(rows, height, width * channels).to(torch.int16)
    up = F.pad(x, (0, 0, 1, 0))[:, :-1]  # the row above; zeros above the first
    left = F.pad(x, (channels, 0))[..., :-channels]  # the same channel of the pixel before
    corner = F.pad(up, (channels, 0))[..., :-channels]
    # Paeth: the one of left, up, corner nearest to left + up - corner (ties in that order)
    pa, pb, pc = (up - corner).abs(), (left - corner).abs(), (left + up - 2 * corner).abs()
    paeth = torch.where((pa <= pb) & (pa <= pc), left, torch.where(pb <= pc, up, corner))
    filtered = torch.stack([x, x - left, x - up, x - ((left + up) >> 1), x - paeth]) & 0xFF
    signed = torch.where(filtered >= 128, filtered - 256, filtered)  # the bytes as int8
    choice = signed.abs().sum(-1, dtype=torch.int64).argmin(0)  # (B, H): the first minimum
    picked = filtered.gather(0, choice[None, :, :, None].expand(1, *x.shape))[0]
    return torch.cat([choice[..., None].to(torch.uint8), picked.to(torch.uint8)], -1)
