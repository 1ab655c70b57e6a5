"""When a running batch counts as stalled: slow is not hung.

Each replica keeps a `StepClock`: the cost of the batch it runs (pixels x frames x rows x CFG
factor) and its measured seconds per unit of cost, calibrated on every denoising step it
reported. A running batch is stalled when no step arrived for

- the first step of a shape this replica has not run since it started (warm-up, and with
  `--compile` compilation): `first_step_timeout`;
- any later step: `max(stall_timeout, STALL_FACTOR x the step's expected time)`,

so a worker whose steps are merely slow is never killed, while a hang on the first step or in
the middle of a run is still caught.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_omni_like.messages import StageRequest

STALL_FACTOR = 10.0  # a step may take this many times its expected time
EMA = 0.3  # weight of the newest step time in the calibration
DEFAULT_SIDE = 64  # a request without a size: its model's default, about this (null stages)


def request_cost(r: StageRequest) -> float:
    """Work of one request per denoising step, in pixel-frames (x2 with guidance)."""
    p = r.params
    guided = p.guidance_scale is None or p.guidance_scale > 1.0
    side_w, side_h = p.width or DEFAULT_SIDE, p.height or DEFAULT_SIDE
    return p.n * side_w * side_h * (p.num_frames or 1) * (2.0 if guided else 1.0)


def batch_cost(batch: list[StageRequest]) -> float:
    return sum(request_cost(r) for r in batch)


@dataclass
class StepClock:
    """One replica's measured step speed, and the stall bound of the batch it runs now."""

    stall_timeout: float
    first_step_timeout: float
    rate: float | None = None  # seconds per unit of cost, measured
    shapes: set[tuple] = field(default_factory=set)  # shapes stepped through since the start
    cost: float = 0.0
    shape: tuple = ()
    last_step: float = 0.0  # the dispatch, then each step's report

    def begin(self, batch: list[StageRequest], now: float) -> None:
        self.cost = batch_cost(batch)
        self.shape = batch[0].batch_key()
        self.last_step = now

    def step(self, now: float) -> None:
        """A step of the running batch was reported: calibrate, and its shape is warm."""
        took = now - self.last_step
        if self.cost > 0:
            sample = took / self.cost
            self.rate = sample if self.rate is None else (1 - EMA) * self.rate + EMA * sample
        self.shapes.add(self.shape)
        self.last_step = now

    def restarted(self) -> None:
        """A new worker process: its shapes are cold again (its speed is the same hardware's)."""
        self.shapes.clear()

    def expected_step_s(self) -> float | None:
        return None if self.rate is None else self.rate * self.cost

    def bound(self) -> tuple[float, str]:
        """Seconds without a step after which the running batch is stalled, and why that many."""
        if self.shape not in self.shapes:
            return self.first_step_timeout, "first step of this shape"
        expected = self.expected_step_s()
        if expected is None or STALL_FACTOR * expected <= self.stall_timeout:
            return self.stall_timeout, "stall timeout"
        return STALL_FACTOR * expected, f"{STALL_FACTOR:g} x its expected step of {expected:.2f}s"
