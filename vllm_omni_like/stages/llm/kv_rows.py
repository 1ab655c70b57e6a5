"""The LLM running set's KV cache as rows: each row's cache left-padded to the set's length.

The set keeps its cache as plain per-layer (keys, values) tensors of shape (rows, heads, length,
dim) and lends the model a `DynamicCache` over them for one step. A step's forward makes new
tensors (the cache appends by concatenation), so a step that fails leaves the set's tensors as
they were. Rows join (`merge`: padded on the left to one length), leave (`keep`), and the
columns no row attends to any more are cut off the left (`trim`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

Layers = list[tuple[torch.Tensor, torch.Tensor]]


def lend(layers: Layers | None) -> Any:
    """A `DynamicCache` over `layers` (no copy); None for a set with no cached column yet."""
    if layers is None:
        return None
    from transformers.cache_utils import DynamicCache, DynamicLayer

    cache = DynamicCache()
    built = []
    for keys, values in layers:
        layer = DynamicLayer()
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        built.append(layer)
    cache.layers = built
    return cache


def taken(cache: Any) -> Layers:
    """The per-layer tensors of a cache the model filled. Only full-attention layers hold every
    column; a sliding-window or recurrent layer cannot be cut into rows this way."""
    from transformers.cache_utils import DynamicLayer

    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        kinds = sorted({type(layer).__name__ for layer in cache.layers})
        raise TypeError(f"a running set needs full-attention cache layers, not {kinds}")
    return [(layer.keys, layer.values) for layer in cache.layers]


def _padded(t: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(t, (0, 0, width - t.shape[-2], 0)) if t.shape[-2] < width else t


def merge(
    a: Layers | None, a_mask: torch.Tensor, b: Layers | None, b_mask: torch.Tensor
) -> tuple[Layers | None, torch.Tensor]:
    """The rows of `a` then those of `b`, each left-padded (masked out) to the longer length."""
    width = max(a_mask.shape[1], b_mask.shape[1])
    mask = torch.cat([F.pad(m, (width - m.shape[1], 0)) for m in (a_mask, b_mask)])
    if a is None and b is None:
        return None, mask
    template = a if a is not None else b
    assert template is not None

    def rows(layers: Layers | None, n: int, i: int, j: int) -> torch.Tensor:
        if layers is None:  # rows with no cached column: all padding
            like = template[i][j]
            return like.new_zeros((n, like.shape[1], width, like.shape[3]))
        return _padded(layers[i][j], width)

    n_a, n_b = a_mask.shape[0], b_mask.shape[0]
    merged = [
        (
            torch.cat([rows(a, n_a, i, 0), rows(b, n_b, i, 0)]),
            torch.cat([rows(a, n_a, i, 1), rows(b, n_b, i, 1)]),
        )
        for i in range(len(template))
    ]
    return merged, mask


def keep(
    layers: Layers | None, mask: torch.Tensor, rows: list[int]
) -> tuple[Layers | None, torch.Tensor]:
    """Only `rows` (in that order); then `trim`."""
    index = torch.tensor(rows, dtype=torch.long, device=mask.device)
    mask = mask.index_select(0, index)
    if layers is not None:
        layers = [(k.index_select(0, index), v.index_select(0, index)) for k, v in layers]
    return trim(layers, mask)


def trim(layers: Layers | None, mask: torch.Tensor) -> tuple[Layers | None, torch.Tensor]:
    """Without the leading columns that no row attends to (left padding the set outgrew)."""
    if mask.shape[0] == 0:
        return None, mask[:, :0]
    used = mask.any(dim=0).nonzero()
    cut = int(used[0]) if used.numel() else mask.shape[1]
    if cut == 0:
        return layers, mask
    mask = mask[:, cut:]
    if layers is not None:
        layers = [(k[:, :, cut:], v[:, :, cut:]) for k, v in layers]
        if mask.shape[1] == 0:
            layers = None
    return layers, mask
