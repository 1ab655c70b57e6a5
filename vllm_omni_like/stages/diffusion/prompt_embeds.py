"""Seeded random prompt embeddings: the stand-in for a text encoder a dummy model leaves out.

Wan2.1's UMT5-XXL encoder (5.7B parameters) is not part of the `wan2.1-t2v-1.3b` architecture
config; with `--load-format dummy` the stage feeds the transformer these embeddings instead, and
the benchmark's plain-diffusers reference does exactly the same, so both sides stay comparable.
The same text always gives the same embedding (seeded by its CRC-32), on any device.
"""

from __future__ import annotations

import zlib

import torch


def random_prompt_embeds(
    texts: list[str], seq_len: int, dim: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """(len(texts), seq_len, dim) standard-normal embeddings, one seeded stream per text."""
    rows = []
    for text in texts:
        gen = torch.Generator(device=device).manual_seed(zlib.crc32(text.encode("utf-8")))
        rows.append(torch.randn(seq_len, dim, generator=gen, device=device, dtype=torch.float32))
    return torch.stack(rows).to(dtype)
