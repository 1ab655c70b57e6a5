"""Seeded random prompt embeddings: the stand-in for a text encoder a dummy model leaves out.

Wan2.1's UMT5-XXL encoder (5.7B parameters) is not part of the `wan2.1-t2v-1.3b` architecture
config; with `--load-format dummy` the stage feeds the transformer these embeddings instead, and
the benchmark's plain-diffusers reference does exactly the same, so both sides stay comparable.
The same text always gives the same embedding (seeded by its CRC-32), on any device.
`PromptEncoder` is our own loop's text conditioning: the text encoders', or these.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni_like.models.adapter import Adapter
from vllm_omni_like.stages.diffusion.row_tensors import Text, cat_rows


def random_prompt_embeds(
    texts: list[str], seq_len: int, dim: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """(len(texts), seq_len, dim) standard-normal embeddings, one seeded stream per text."""
    rows = []
    for text in texts:
        gen = torch.Generator(device=device).manual_seed(zlib.crc32(text.encode("utf-8")))
        rows.append(torch.randn(seq_len, dim, generator=gen, device=device, dtype=torch.float32))
    return torch.stack(rows).to(dtype)


@dataclass(frozen=True)
class PromptEncoder:
    """A batch's text conditioning (step.py's `Embed`): the text encoders', or a dummy's seeded
    random embeddings (`random_shape`: (seq_len, dim); None: a negative prompt not given)."""

    adapter: Adapter
    device: torch.device
    tokenizer: Any  # a transformers tokenizer, or None
    random_shape: tuple[int, int] | None
    dtype: torch.dtype  # the denoiser's (random embeddings only)
    # the text encoders are compiled (--compile-text-encoders): each text encoded alone, so an
    # encoder sees one shape whatever a join's count of texts (the warm-up's: nothing compiles
    # on a request)
    one_text_a_call: bool = False

    def __call__(self, texts: list[str | None], images: list[Any] | None = None) -> Text:
        """`images`: what each text is read with, where the family's text reads an image (a
        dummy's random embeddings read none)."""
        if texts == [None] and images is None:
            return self._absent
        return self._encode(texts, images)

    @functools.cached_property
    def _absent(self) -> Text:
        """The absent text's conditioning (a batch's negative prompt where none was given,
        encoded alone as `rows` encodes a batch's negatives): the same for every request -
        nothing of a request reaches the encoders (no LoRA or per-request length reads them) -
        so encoded once, on first use (the warm-up's), and kept (`rows` joins it to the
        prompts' rows: a copy, the kept one never changes)."""
        return self._encode([None], None)

    def _encode(self, texts: list[str | None], images: list[Any] | None) -> Text:
        if self.random_shape is not None:
            seq_len, dim = self.random_shape
            given = [t or "" for t in texts]
            return random_prompt_embeds(given, seq_len, dim, self.dtype, self.device)
        if images is not None:
            return self.adapter.encode_text_with_images(texts, images, self.device)
        max_length = self.tokenizer.model_max_length if self.tokenizer is not None else 512
        if not self.one_text_a_call:
            return self.adapter.encode_text(texts, self.device, max_length)
        encoded = [self.adapter.encode_text([t], self.device, max_length) for t in texts]
        return functools.reduce(cat_rows, encoded)
