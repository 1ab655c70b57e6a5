"""The rows-first tensors our loop keeps beside its latents (step.py, rows.py): a batch's text
conditioning, a row a distinct text, and its rows' own conditioning from an image, a row a
latent row (models/row_conditions.py); taken, padded and joined row by row."""

from __future__ import annotations

from typing import Any

import torch

from vllm_omni_like.models.columns import to_device
from vllm_omni_like.models.row_conditions import Conditioning
from vllm_omni_like.models.text_buckets import pad_tokens

# a batch's text conditioning: embeddings (rows, seq, dim), or named tensors with rows first
# (SDXL's embeddings and pooled embeddings; a "mask" where texts keep their own lengths)
Text = torch.Tensor | dict[str, torch.Tensor]


def row_index(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row positions as an index tensor on `device` (a pinned, non-blocking copy)."""
    return to_device(torch.tensor(rows, dtype=torch.long), device)


def take(text: Text, rows: list[int], device: torch.device) -> Text:
    """The text rows `rows`."""
    if isinstance(text, dict):
        return take_named(text, rows, device)
    return text[row_index(rows, device)]


def take_named(values: dict[str, torch.Tensor], rows: list[int], device: torch.device) -> dict:
    """The rows `rows` of each named tensor (a value kept on the host - Z-Image's token
    counts - picked there: nothing waits for the device)."""
    index = row_index(rows, device)
    host = torch.tensor(rows, dtype=torch.long)
    return {k: v[index] if v.device == index.device else v[host] for k, v in values.items()}


def pad_tensor(value: torch.Tensor, pad: int) -> torch.Tensor:
    """`pad` more rows, copies of the last."""
    return torch.cat([value, value[-1:].expand(pad, *value.shape[1:])])


def pad_rows(value: Text, pad: int) -> Text:
    if isinstance(value, dict):
        return pad_named(value, pad)
    return pad_tensor(value, pad)


def pad_named(values: dict[str, torch.Tensor], pad: int) -> dict[str, torch.Tensor]:
    return {k: pad_tensor(v, pad) for k, v in values.items()}


def pad_each(pad: int, *values: Any) -> tuple[Any, ...]:
    """Each of `values` (rows-first tensors, named or not; None stays None), `pad` rows more."""
    return tuple(None if v is None else pad_rows(v, pad) for v in values)


def cat_rows(a: Text, b: Text) -> Text:
    if isinstance(a, dict) and isinstance(b, dict):
        if "mask" in a:  # texts of their own lengths: both padded to the longer, masked
            length = max(a["mask"].shape[1], b["mask"].shape[1])
            a, b = pad_tokens(a, length), pad_tokens(b, length)
        return cat_named(a, b)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.cat([a, b])
    raise TypeError("text conditionings of two kinds")


def cat_named(a: Conditioning, b: Conditioning) -> Conditioning:
    """`a`'s rows, then `b`'s, of each named tensor."""
    return {k: torch.cat([a[k], b[k]]) for k in a}


def text_dtype(text: Text) -> torch.dtype:
    return next(iter(text.values())).dtype if isinstance(text, dict) else text.dtype
