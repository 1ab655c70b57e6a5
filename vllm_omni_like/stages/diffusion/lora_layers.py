"""Many LoRA adapters in one forward: a linear layer's base matmul once, then each row's
low-rank update from a device pool by the row's adapter slots.

`LoraLinear` wraps a denoiser's linear layer - an `nn.Linear`, or `--quantization fp8`'s
`Fp8Linear` (fp8.py): the one wrapper of a linear layer both take - and holds its slice of the
pool: `lora_a` (slots, parts x rank, in) and `lora_b` (slots, parts x rank, out), slot 0 all
zeros (a row without an adapter). A forward reads the batch's `LoraContext`: each model row's
adapter slots (rows, K: `--max-loras-per-request`), a device tensor, and their scales; the
update is its kernel's (lora_kernels.py: the rows' A and B gathered, or the pool's slots read
once each), so a new mix of adapters is new values in the same tensors: nothing recompiles.
An adapter's weights are written into its slot in place (lora_pool.py), ranks below the pool's
padded with zeros (the same product); its alpha / rank is folded into B as it is written. The
base weights are never touched.

A fused projection (diffusers' `fuse_qkv_projections`: `to_qkv`, a cross-attention's `to_kv`,
the added `to_added_qkv`) takes a fused B: its parts' A stacked on the rank axis and their B
block-diagonal, so `attn.to_q`'s adapter lands in the rows of `to_qkv`'s output that are q.
"""

from __future__ import annotations

import contextlib
import fnmatch
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from vllm_omni_like.models.columns import to_device
from vllm_omni_like.stages.diffusion.fp8 import Fp8Linear
from vllm_omni_like.stages.diffusion.lora_kernels import UPDATES

# a fused projection's parts, in the order its weights were concatenated (diffusers' own)
FUSED = {
    "to_qkv": ("to_q", "to_k", "to_v"),
    "to_kv": ("to_k", "to_v"),
    "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj"),
}
LINEARS = (torch.nn.Linear, Fp8Linear)


class LoraContext:
    """The adapters of the next denoiser call's model rows, shared by every `LoraLinear` of
    the denoisers (None: no adapter step; the base layers alone)."""

    def __init__(self) -> None:
        self.index: torch.Tensor | None = None  # (rows, K) int64: each row's slots
        self.scale: torch.Tensor | None = None  # (rows, K): each slot's scale

    @contextlib.contextmanager
    def rows(self, lora: tuple[torch.Tensor, torch.Tensor] | None) -> Iterator[None]:
        """Within it, the denoiser's calls run `lora`'s (index, scale) rows."""
        self.index, self.scale = (None, None) if lora is None else lora
        try:
            yield
        finally:
            self.index = self.scale = None


class LoraLinear(torch.nn.Module):
    lora_a: torch.Tensor
    lora_b: torch.Tensor

    def __init__(
        self,
        base: torch.nn.Linear | Fp8Linear,
        slots: int,
        rank: int,
        parts: tuple[int, ...],
        context: LoraContext,
        dtype: torch.dtype,
        kernel: str = "gather",
    ) -> None:
        super().__init__()
        self.kernel = kernel  # (lora_kernels.py: its `choose` at the pool's build)
        self.base = base
        self.in_features: int = base.in_features
        self.out_features: int = base.out_features
        assert sum(parts) == self.out_features, (parts, self.out_features)
        self.rank, self.parts, self.context = rank, parts, context
        device = next(itertools.chain(base.buffers(), base.parameters())).device
        wide = rank * len(parts)
        a = torch.zeros(slots, wide, self.in_features, dtype=dtype, device=device)
        b = torch.zeros(slots, wide, self.out_features, dtype=dtype, device=device)
        self.register_buffer("lora_a", a, persistent=False)
        self.register_buffer("lora_b", b, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        index, scale = self.context.index, self.context.scale
        if index is None or scale is None:
            return out
        flat = x.reshape(x.shape[0], -1, self.in_features).to(self.lora_a.dtype)
        update = UPDATES[self.kernel](flat, self.lora_a, self.lora_b, index, scale)
        return out + update.reshape(out.shape).to(out.dtype)

    @torch.no_grad()
    def write(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Part `part`'s adapter in `slot`: `a` (rank, in), `b` (part's out, rank), its scale
        folded in; the rest of the part's rank stays zero."""
        rank, start = a.shape[0], part * self.rank
        top = sum(self.parts[:part])
        # (through pinned memory: a copy from pageable memory waits for the device - a join
        # would wait for the running set's steps)
        self.lora_a[slot, start : start + rank].copy_(to_device(a, self.lora_a.device))
        rows = slice(top, top + self.parts[part])
        self.lora_b[slot, start : start + rank, rows].copy_(to_device(b.T, self.lora_b.device))

    @torch.no_grad()
    def clear(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def extra_repr(self) -> str:
        slots = self.lora_a.shape[0]
        return f"rank={self.rank}, parts={len(self.parts)}, slots={slots}, kernel={self.kernel}"


@dataclass(frozen=True)
class Target:
    """Where an adapter's module lands: its layer and, in a fused one, its part."""

    layer: LoraLinear
    part: int
    in_features: int
    out_features: int


def wrap(
    model: torch.nn.Module,
    patterns: tuple[str, ...],
    slots: int,
    rank: int,
    context: LoraContext,
    dtype: torch.dtype,
    kernel: str = "gather",
) -> dict[str, Target]:
    """Wrap `model`'s linear layers whose names match `patterns` (fnmatch; a fused projection
    by its parts' names) in `LoraLinear`s; returns each module name an adapter may target."""
    targets: dict[str, Target] = {}
    modules = list(model.named_modules())  # (as they were: no wrapper is wrapped again)
    done: set[str] = set()  # a fused projection's parts and itself
    for name, module in modules:
        if not getattr(module, "fused_projections", False):
            continue
        for fused, parts in FUSED.items():
            linear = getattr(module, fused, None)
            names = [f"{name}.{p}" if name else p for p in parts]
            if not isinstance(linear, LINEARS) or not any(_matches(n, patterns) for n in names):
                continue
            outs = tuple(getattr(module, p).out_features for p in parts)
            layer = LoraLinear(linear, slots, rank, outs, context, dtype, kernel)
            setattr(module, fused, layer)
            for i, (n, out) in enumerate(zip(names, outs, strict=True)):
                targets[n] = Target(layer, i, linear.in_features, out)
            done.update([*names, f"{name}.{fused}" if name else fused])
    for name, module in modules:
        if name in done or not isinstance(module, LINEARS) or not _matches(name, patterns):
            continue
        layer = LoraLinear(module, slots, rank, (module.out_features,), context, dtype, kernel)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
        targets[name] = Target(layer, 0, module.in_features, module.out_features)
    return targets


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)
