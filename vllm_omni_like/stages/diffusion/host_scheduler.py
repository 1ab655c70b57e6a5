"""A UniPC scheduler whose steps never wait on the device.

diffusers' `UniPCMultistepScheduler` (Wan's) computes each step's coefficients with small
tensors on the latents' device: it copies CPU sigmas there (`.to(device)` from pageable memory
waits for the device to drain) and its corrector calls `torch.linalg.solve`, which reads an error
flag back. Each step the host therefore waits for the forward to end before it can launch the
next one, and the device idles while the host runs the scheduler and the next launches (5.7 ms
a step on an H100 for Wan2.1-1.3B, more with CFG-parallel, where the other rank waits too).

Both UniPC updates (predictor and corrector) are linear in the tensors they combine: the sample
and the model outputs. So the coefficients are read on the host by running diffusers' own update
on unit vectors (on the CPU, where the sigmas live), and the step applies them to the device
tensors as plain numbers: the same maths, no read-back, and the host runs ahead of the device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from diffusers import UniPCMultistepScheduler


def _combine(coefficients: torch.Tensor, tensors: list[torch.Tensor]) -> torch.Tensor:
    """sum(c * t) for the coefficients (a CPU vector) and the tensors, as Python floats."""
    values = coefficients.tolist()
    out = tensors[0] * values[0]
    for value, tensor in zip(values[1:], tensors[1:], strict=True):
        out = out.add(tensor, alpha=value)  # (promotes a bf16 input as `a * x + b * y` would)
    return out


class HostUniPC(UniPCMultistepScheduler):
    """`UniPCMultistepScheduler` whose per-step coefficients are computed on the host."""

    model_outputs: list[Any]  # (the parent's state, which the coefficients read)
    sigmas: torch.Tensor

    def _coefficients(self, update: Callable[[torch.Tensor, torch.Tensor], Any], order: int):
        """The coefficients of `update(sample, this_model_output)` (a parent's update), in the
        order sample, the last `order` model outputs, this model output: the update run on unit
        vectors, with the sigmas on the CPU."""
        basis = list(torch.eye(order + 2, dtype=torch.float32).unsqueeze(1))  # each (1, order+2)
        saved, saved_sigmas = self.model_outputs, self.sigmas
        self.model_outputs = [None] * (len(saved) - order) + basis[1 : 1 + order]
        self.sigmas = saved_sigmas.cpu()
        try:
            return update(basis[0], basis[-1])[0]
        finally:
            self.model_outputs, self.sigmas = saved, saved_sigmas

    def _last(self, order: int) -> list[torch.Tensor]:
        return self.model_outputs[len(self.model_outputs) - order :]

    def multistep_uni_p_bh_update(
        self, model_output: torch.Tensor, *args: Any, sample: torch.Tensor, order: int, **kw: Any
    ) -> torch.Tensor:
        parent = super().multistep_uni_p_bh_update
        if self.solver_p or args or kw:
            return parent(model_output, *args, sample=sample, order=order, **kw)
        found = self._coefficients(lambda x, _: parent(model_output, sample=x, order=order), order)
        # (the predictor does not use this model output: its coefficient is 0)
        return _combine(found[:-1], [sample, *self._last(order)]).to(sample.dtype)

    def multistep_uni_c_bh_update(
        self,
        this_model_output: torch.Tensor,
        *args: Any,
        last_sample: torch.Tensor,
        this_sample: torch.Tensor,
        order: int,
        **kw: Any,
    ) -> torch.Tensor:
        parent = super().multistep_uni_c_bh_update
        if args or kw:
            return parent(
                this_model_output,
                *args,
                last_sample=last_sample,
                this_sample=this_sample,
                order=order,
                **kw,
            )
        found = self._coefficients(
            lambda x, m: parent(m, last_sample=x, this_sample=x, order=order), order
        )
        tensors = [last_sample, *self._last(order), this_model_output]
        return _combine(found, tensors).to(last_sample.dtype)


def host_scheduler(pipe: Any) -> bool:
    """Give the pipeline a `HostUniPC` if it runs diffusers' UniPC (same config); whether it
    did."""
    scheduler: Any = getattr(pipe, "scheduler", None)
    if type(scheduler) is not UniPCMultistepScheduler:
        return False
    pipe.scheduler = HostUniPC.from_config(scheduler.config)
    return True
