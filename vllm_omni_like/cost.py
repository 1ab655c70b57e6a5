"""One cost model for admission, stall bounds and routing.

The work of a request at a stage is counted in *units*: per denoising step, its pixels x frames
x images x the CFG factor (2 where guidance runs a second branch); for a text stage, one unit per
row and decoding step. Its whole work is that times its steps. Each replica turns units into
seconds with its own measured rate (seconds per unit), calibrated on every step it reports
(`Speed`), so a faster GPU, a compiled model or a different pipeline each get their own figure.

- admission: a pipeline refuses work once what it holds would take more than
  `--max-queue-seconds` to drain (and tells `Retry-After` in those seconds);
- the stall bound: a step may take `STALL_FACTOR` x its expected seconds (engine/stall.py);
- routing: a batch goes to the replica whose queued work would end first (engine/routing.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from vllm_omni_like.params import GenerationParams

DEFAULT_SIDE = 64  # a request without a size: its model's default, about this (null stages)
DEFAULT_STEPS = 20  # a diffusion model's steps when neither the request nor its options say
EMA = 0.3  # weight of the newest step time in the calibration


def step_units(params: GenerationParams, text: bool = False) -> float:
    """Units of one step of one request: one row for a text stage; else pixel-frames x images,
    doubled when classifier-free guidance runs its second branch."""
    if text:
        return 1.0
    guided = params.guidance_scale is None or params.guidance_scale > 1.0
    width, height = params.width or DEFAULT_SIDE, params.height or DEFAULT_SIDE
    return params.n * width * height * (params.num_frames or 1) * (2.0 if guided else 1.0)


def steps_of(params: GenerationParams, default_steps: int, text: bool = False) -> int:
    if text:
        return params.max_new_tokens or default_steps
    return params.num_inference_steps or default_steps


def work_units(params: GenerationParams, default_steps: int, text: bool = False) -> float:
    """A request's whole work at a stage."""
    return step_units(params, text) * steps_of(params, default_steps, text)


@dataclass
class Speed:
    """One replica's measured seconds per unit of work (None until its first step)."""

    rate: float | None = None

    def sample(self, seconds: float, units: float) -> None:
        if units <= 0:
            return
        s = seconds / units
        self.rate = s if self.rate is None else (1 - EMA) * self.rate + EMA * s

    def seconds(self, units: float) -> float | None:
        return None if self.rate is None else self.rate * units


def parallel_rate(rates: Iterable[float | None]) -> float | None:
    """Seconds per unit of replicas working side by side (1 / the sum of their speeds); None
    while none has been measured."""
    speed = sum(1.0 / r for r in rates if r)
    return 1.0 / speed if speed > 0 else None
