"""A patch-parallel decode: each of a replica's N ranks decodes a band of the latent rows, with the
rows its convolutions reach beyond the band on each side (the halo) decoded too and cut off
after, and the bands are gathered into the whole picture on every rank.

A convolution's output row depends on its input rows within its radius; a stack of them, on
the rows within the sum of their radii (each counted at its own scale: a convolution after a
2x upsampling reaches half a latent row). So a band decoded with that many latent rows of halo
on each side gives the same pixels, row for row, as the whole picture decoded at once: zero
padding at the window's edges only reaches into the halo. What the halo is, and where in a
VAE the bands are cut, is the family's (models/<family>/patch_decode.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni_like.parallel.ulysses import gather_single, pad_dim


@dataclass(frozen=True)
class Window:
    """A rank's band of latent rows, [start, end) (empty where there are fewer rows than
    ranks), and the rows it decodes for it, [low, high): the band and its halo."""

    start: int
    end: int
    low: int
    high: int

    def kept(self, scale: int) -> slice:
        """The band's rows in the decode of the window, `scale` output rows a latent row."""
        return slice((self.start - self.low) * scale, (self.end - self.low) * scale)


class Bands:
    """One rank's side of the N: its band of a picture's latent rows, and the whole picture
    back from every rank's band."""

    def __init__(self, rank: int, size: int, group: Any) -> None:
        self.rank = rank
        self.size = size
        self.group = group

    def window(self, rows: int, halo: int) -> Window:
        """This rank's band of `rows` latent rows, ceil(rows / N) of them (the last bands may
        be shorter or empty), and the window it decodes; an empty band decodes the last rows
        (work thrown away: every rank takes part in each exchange)."""
        per = -(-rows // self.size)
        start = min(self.rank * per, rows)
        end = min(start + per, rows)
        low, high = max(0, start - halo), min(rows, end + halo)
        if start == end:
            low = max(0, rows - 1 - halo)
        return Window(start, end, low, high)

    def gather(self, band: torch.Tensor, dim: int, rows: int, scale: int) -> torch.Tensor:
        """The whole picture, `rows` x `scale` rows along `dim`, from every rank's `band` of
        it (this rank's: its window's kept rows)."""
        per = -(-rows // self.size) * scale
        first = pad_dim(band, dim, per).movedim(dim, 0).contiguous()
        whole = gather_single(first, 0, self.group)
        return whole.narrow(0, 0, rows * scale).movedim(0, dim)
