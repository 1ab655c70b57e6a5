"""A LoRA layer's update of a forward's rows, two ways (the layer and its pool: lora_layers.py).

Both take the rows' input `x` (rows, tokens, in), the layer's pool - `lora_a` (slots, wide,
in) and `lora_b` (slots, wide, out), slot 0 all zeros - and the rows' slots `index` (rows, K)
and `scale` (rows, K), device tensors of the batch: a new mix of adapters is new values in
tensors of the same shapes (nothing recompiles, no host sync), and both return the update
(rows, tokens, out), equal within rounding.

- `gather`: each row's K slots' A and B gathered (rows x K copies: memory traffic of rows x K
  x wide x (in + out) a layer, written and read again) and applied in two batched matmuls;
  multiply-adds of rows x tokens x K x wide x (in + out).
- `pooled`: the rows that share a slot read its A and B once: every slot of the pool (slot 0
  left out) in two plain matmuls over all the batch's tokens, each row's share kept by a
  (rows, slots) coefficient matrix scattered from its slots and scales (a one-hot combine; a
  slot a row names twice adds its scales, as the gather does). No copy of A or B; multiply-adds
  of rows x tokens x max_loras x wide x (in + out).

`choose` picks one a layer at the pool's build, by the device and the pool's sizes, as
bench/lora_kernels.py measured them (the same layer shapes and batches on each device):
- CUDA: `gather`, always. On an NVIDIA H100 (bf16, eager) the gather was the faster in 99 of
  100 cases (the other within 4%); where the pool was no larger than K the pooled kernel took
  0.97-1.14x the gather's time (median 1.09x), 1.2x at 8 slots and 2.7x at 32 (medians;
  bench/results/lora_kernels-h100.json).
- Elsewhere (the CPU): `pooled` where it does no more multiply-adds than the gather
  (`--max-loras` <= `--max-loras-per-request`): it saves the gathered copies and runs two large
  matmuls instead of `rows` narrow ones, 0.66-0.96x the gather's time at 32 rows of SD1.5's
  shapes (fp32, 2 cores; bench/results/lora_kernels-cpu.json); `gather` otherwise (pooled
  took 1.2-7x it).
A grouped GEMM over the rows sorted by slot (`torch._grouped_mm`) was timed beside them on
the H100 and took 4.8x the gather's time (its copies of the activations): not served.
"""

from __future__ import annotations

import torch

KERNELS = ("gather", "pooled")


def choose(max_loras: int, per_row: int, device: torch.device) -> str:
    """The kernel of a pool of `max_loras` adapters, `per_row` a row, on `device` (module
    docstring: what each device measured)."""
    if device.type == "cuda":
        return "gather"
    return "pooled" if max_loras <= per_row else "gather"


def gather(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    index: torch.Tensor,
    scale: torch.Tensor,
) -> torch.Tensor:
    rows, per_row = index.shape
    wide, out = lora_b.shape[1], lora_b.shape[2]
    a = lora_a[index].reshape(rows, per_row * wide, lora_a.shape[2])  # (rows, K x wide, in)
    b = lora_b[index].reshape(rows, per_row * wide, out)  # (rows, K x wide, out)
    low = torch.bmm(x, a.transpose(1, 2))  # (rows, tokens, K x wide)
    low = low * scale.to(low.dtype).repeat_interleave(wide, dim=1).unsqueeze(1)
    return torch.bmm(low, b)


def pooled(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    index: torch.Tensor,
    scale: torch.Tensor,
) -> torch.Tensor:
    rows, tokens = x.shape[0], x.shape[1]
    slots, wide = lora_a.shape[0], lora_a.shape[1]
    coef = torch.zeros(rows, slots, dtype=torch.float32, device=x.device)
    coef = coef.scatter_add(1, index, scale.to(torch.float32))[:, 1:]  # (rows, slots - 1)
    a = lora_a[1:].reshape((slots - 1) * wide, lora_a.shape[2])  # (a view: no copy)
    b = lora_b[1:].reshape((slots - 1) * wide, lora_b.shape[2])
    low = x.reshape(rows * tokens, -1) @ a.T  # (rows x tokens, slots' wide)
    low = low.view(rows, tokens, slots - 1, wide) * coef.to(low.dtype)[:, None, :, None]
    return (low.view(rows * tokens, -1) @ b).view(rows, tokens, -1)


UPDATES = {"gather": gather, "pooled": pooled}
