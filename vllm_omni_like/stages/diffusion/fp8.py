"""Rowwise dynamic FP8 linear layers (`--quantization fp8`), written over `torch._scaled_mm`.

A weight is quantized once, at load, to float8_e4m3fn with one float32 scale per output row
(its largest magnitude over 448, e4m3's largest value); an activation is quantized at each call
the same way, one scale per row (per token), so an outlier token costs only its own row's
precision. The product runs on `torch._scaled_mm` with both rowwise scales, its result in the
activations' dtype (bf16 on CUDA: the rowwise kernels write bf16; any on the CPU, whose
`_scaled_mm` takes rowwise scales too, so the CPU tests run this very path). Under
torch.compile the activation's quantization fuses into the kernels around it.

Why our own layer and not torchao's (the `fp8` extra pins torchao; the benchmark's
plain-diffusers reference runs it): torchao 0.18's `quantize_` refuses any device but CUDA >= 8.9,
MI300 and XPU (an assertion in its hardware check), so the CPU could not run the served path;
and this is a plain module of plain tensors (buffers), with no tensor subclass for
torch.compile to trace through, that the architecture's one `Linear` wrapper for LoRA and FP8
can hold. The maths is the same - per-row scales, e4m3, amax / 448 - but for the scales'
rounding: torchao divides in the weights' dtype (a bf16 scale), ours in float32
(tests/stages/diffusion/test_fp8.py checks ours against torchao's `Float8Tensor`). Both reuse
their compiled graphs from the disk cache (FX graph and AOT autograd caches hit in a second
process, CPU, 2026-12-06).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
MIN_AMAX = 1e-12  # a row of zeros (a padded row) gets a tiny scale, not a division by zero


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (rows, features) -> (float8_e4m3fn values, float32 scales (rows, 1)): each row over
    its largest magnitude, in float32, clamped to e4m3's range."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=MIN_AMAX)
    scale = amax / FP8_MAX
    values = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values, scale


class Fp8Linear(torch.nn.Module):
    """`nn.Linear`'s maths with an FP8 weight (float8_e4m3fn, one float32 scale per output row)
    and each call's input quantized per row. The weight and its scales are buffers named
    `qweight` and `weight_scale`, not `weight`: code that reads a linear layer's `weight`
    (its dtype, to cast an input) fails loudly here rather than casting to FP8."""

    qweight: torch.Tensor  # (out_features, in_features) float8_e4m3fn
    weight_scale: torch.Tensor  # (out_features, 1) float32

    def __init__(self, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: Any) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("weight_scale", weight_scale)
        self.bias = bias  # a Parameter in the weights' dtype, or None

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> Fp8Linear:
        """`linear`'s weight quantized where it is (its device), its bias kept as it is."""
        with torch.no_grad():
            qweight, scale = quantize_rows(linear.weight)
        return cls(qweight, scale, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        values, scale = quantize_rows(rows)
        out = torch._scaled_mm(
            values,
            self.qweight.t(),  # column-major, as the kernels want their second operand
            scale_a=scale,
            scale_b=self.weight_scale.t(),
            bias=self.bias,
            out_dtype=x.dtype,
        )
        return out.reshape(*shape[:-1], self.out_features)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """A model's `.to(dtype)` casts its floating tensors: here only the bias follows it;
        the FP8 weight and its float32 scales move (`.to(device)`) but keep their dtypes."""
        before = {"qweight": self.qweight, "weight_scale": self.weight_scale}
        super()._apply(fn, recurse)
        for name, tensor in before.items():
            after = getattr(self, name)
            if after.dtype != tensor.dtype:  # cast: the original, moved where `fn` put it
                setattr(self, name, tensor.to(after.device))
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 rowwise"


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal to quantization noise, in dB: the reference's power over the error's (inf when
    they are equal)."""
    ref = reference.double()
    noise = (ref - approx.double()).pow(2).mean().item()
    signal = ref.pow(2).mean().item()
    return math.inf if noise == 0 else 10 * math.log10(signal / noise)


def layer_sqnr(linear: torch.nn.Linear, x: torch.Tensor) -> float:
    """The SQNR of `linear`'s FP8 version on the input `x`, against `linear` itself."""
    with torch.no_grad():
        return sqnr_db(linear(x), Fp8Linear.from_linear(linear)(x))
