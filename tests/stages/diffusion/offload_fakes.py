"""A fake `Transfer` for `--offload idle-expert` on the CPU (stages/diffusion/offload.py): masters
and device copies are CPU clones; it counts the copies an offload still holds (its device
memory: set in the experts' modules, or prefetched), the marks and the waits, and may fail its
n-th copy (out of memory). `TwoExperts`: an adapter's two experts over any two models, a row's
chosen by Wan's own rule."""

from __future__ import annotations

from typing import Any

import torch

from vllm_omni_like.models.adapter import Expert
from vllm_omni_like.models.wan.adapter import WanAdapter


class TwoExperts:
    """What the offload asks of an adapter (`experts`, `expert_for`): `models` as Wan2.2's
    `transformer` (high noise, from `boundary` down) and `transformer_2`."""

    expert_for = WanAdapter.expert_for  # (it reads `experts()` only)

    def __init__(self, models: list[torch.nn.Module], boundary: float) -> None:
        self.models, self.boundary = models, boundary

    def experts(self) -> list[Expert]:
        first = Expert("transformer", self.models[0], self.boundary)
        return [first, Expert("transformer_2", self.models[1])]


class FakeTransfer:
    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at  # the copy (counted from 1) that raises
        self.copies = 0
        self.begins = 0
        self.marks = 0
        self.waited: list[int] = []  # marks the compute stream waited for, in order
        self.made: list[torch.Tensor] = []  # (kept: no copy's memory is reused by another)

    def masters(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return [t.clone() for t in tensors]

    def idle(self, master: torch.Tensor) -> torch.Tensor:
        return master

    def begin(self) -> None:
        self.begins += 1

    def copy(self, master: torch.Tensor) -> torch.Tensor:
        self.copies += 1
        if self.copies == self.fail_at:
            raise torch.OutOfMemoryError("fake: out of device memory in a copy")
        out = master.clone()
        self.made.append(out)
        return out

    def mark(self) -> Any:
        self.marks += 1
        return self.marks

    def wait(self, mark: Any) -> None:
        self.waited.append(mark)

    def seconds(self, start: Any, end: Any) -> float | None:
        return 0.001 * (end - start)

    def held(self, offload: Any) -> int:
        """The copies `offload` holds: in its experts' modules, or prefetched."""
        made = {t.data_ptr() for t in self.made}
        now = []
        for units in offload.units:
            for unit in units:
                for slot in unit.slots:
                    now.append(getattr(slot.owner, slot.name).data_ptr())
        staged = [
            c.data_ptr() for units in offload.staged.values() for _, cs, _ in units for c in cs
        ]
        return sum(1 for ptr in now + staged if ptr in made)
