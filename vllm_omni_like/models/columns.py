"""Per-row scalars applied to a batch as diffusers applies one scalar to one row.

A scheduler's step multiplies the sample and the model output by float32 0-dim scalars. A batch
of rows at their own positions needs one scalar per row: a (B, 1, ..., 1) float32 column. Where
every row has the same value (one schedule, one position: the common batch) the scalar stays a
0-dim CPU tensor, exactly what diffusers passes: no copy to the device, no kernel for it. Either
way `mul` and `div` leave the product in the tensor's dtype, as a 0-dim scalar does.
"""

from __future__ import annotations

import functools

import torch


def to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host values on the device without the host waiting for it: a copy from pageable
    memory would wait until the device drained (each step would wait for the last forward)."""
    if device.type != "cuda":
        return values
    return values.pin_memory().to(device, non_blocking=True)


class Cols:
    """The rows' scalars (`scalars[b][name]`, float32 values) by name, made when asked: a
    0-dim CPU tensor where all rows agree, else a column on the device of `like`."""

    def __init__(self, scalars: list[dict[str, float]], like: torch.Tensor) -> None:
        self.scalars, self.like = scalars, like
        self.made: dict[str, torch.Tensor] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.made:
            self.made[name] = column([s[name] for s in self.scalars], self.like)
        return self.made[name]


def column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    if all(v == values[0] for v in values):
        return _scalar(values[0])
    shape = (len(values),) + (1,) * (like.dim() - 1)
    return to_device(torch.tensor(values, dtype=torch.float32).view(shape), like.device)


@functools.lru_cache(maxsize=8192)
def _scalar(value: float) -> torch.Tensor:
    """A float32 0-dim CPU tensor of `value`, made once (a schedule's scalars recur every batch;
    nothing writes to them)."""
    return torch.tensor(value, dtype=torch.float32)


def mul(scalar: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """`scalar * tensor`, in the tensor's dtype (a column's product is rounded to it once)."""
    return (scalar * tensor).to(tensor.dtype)


def div(tensor: torch.Tensor, scalar: torch.Tensor) -> torch.Tensor:
    return (tensor / scalar).to(tensor.dtype)
