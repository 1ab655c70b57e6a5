"""Text-length buckets (Qwen-Image, Z-Image): each prompt's tokens padded on, with a mask, to
the smallest of a few lengths (`pad_tokens`), so a compiled denoiser sees one text shape per
bucket and rows of many prompts share a forward; and the prompts a compiled stage warms every
bucket up with, so no request's prompt compiles one at run time.

The buckets were picked by measurement (bench/README.md, "masked attention"): the mask, not the
bucket, is what costs; a larger step between buckets costs less than a recompile.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

TEXT_BUCKETS = (64, 128, 256, 512)  # tokens a text is padded to (the smallest that holds it)
WORD = "red"  # what a warm-up prompt repeats


def text_bucket(tokens: int, buckets: tuple[int, ...] = TEXT_BUCKETS) -> int:
    """The bucket `tokens` tokens are padded to (themselves past the last one)."""
    return next((b for b in buckets if b >= tokens), tokens)


def bucket_prompts(
    count: Callable[[str], int], buckets: tuple[int, ...] = TEXT_BUCKETS
) -> tuple[str, ...]:
    """One prompt for each bucket, its token count (`count`: the family's encoder's, template
    included) within the bucket and above the one before; a bucket no prompt reaches (an
    encoder that truncates before it) is left out."""
    count = functools.cache(count)  # (each range measures one and two words again)
    bounds = zip((0, *buckets), buckets, strict=False)
    return tuple(p for low, high in bounds if (p := prompt_within(count, low, high)) is not None)


def prompt_within(count: Callable[[str], int], low: int, high: int, tries: int = 16) -> str | None:
    """A prompt of `WORD` repeated whose token count is in (`low`, `high`], or None where none
    is. The count of k words is affine in k (measured at 1 and 2), so the first guess lands near
    the range's middle; each guess is checked and moved by the words it missed by."""

    def prompt(words: int) -> str:
        return " ".join([WORD] * words)

    one = count(prompt(1))
    per = max(count(prompt(2)) - one, 1)
    target = (low + high + 1) // 2
    words = max(1, 1 + round((target - one) / per))
    for _ in range(tries):
        tokens = count(prompt(words))
        if low < tokens <= high:
            return prompt(words)
        step = round((target - tokens) / per) or (1 if tokens <= low else -1)
        words = max(1, words + step)
    return None


def pad_tokens(text: dict[str, torch.Tensor], length: int) -> dict[str, torch.Tensor]:
    """A masked text's tensors (those with a token axis: the embeddings, the mask) padded with
    zeros to `length` tokens; a padded token is masked out, so a row's result is unchanged."""
    have = text["mask"].shape[1]
    if have == length:
        return text
    return {
        k: zero_pad(v, length) if v.dim() >= 2 and v.shape[1] == have else v
        for k, v in text.items()
    }


def zero_pad(x: torch.Tensor, length: int) -> torch.Tensor:
    """`x` (B, L, ...) with zeros to `length` on its second dimension (as it is if as long)."""
    if x.shape[1] >= length:
        return x
    return torch.cat([x, x.new_zeros((x.shape[0], length - x.shape[1], *x.shape[2:]))], dim=1)
