"""When a running batch counts as stalled: slow is not hung.

Each replica keeps a `StepClock`: the units of work of one step of the batch it runs (the cost
model of cost.py) and its measured seconds per unit (`Speed`), calibrated on every step
it reported. A running batch is stalled when no step arrived for

- the first step of a shape this replica has not run since it started (warm-up, and with
  `--compile` compilation): `first_step_timeout`;
- any later step: `max(stall_timeout, STALL_FACTOR x the step's expected time)`,

so a worker whose steps are merely slow is never killed, while a hang on the first step or in
the middle of a run is still caught.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_omni_like.cost import Speed

STALL_FACTOR = 10.0  # a step may take this many times its expected time


@dataclass
class StepClock:
    """One replica's measured step speed, and the stall bound of the batch it runs now."""

    stall_timeout: float
    first_step_timeout: float
    speed: Speed = field(default_factory=Speed)  # seconds per unit of work, measured
    shapes: set[tuple] = field(default_factory=set)  # shapes stepped through since the start
    units: float = 0.0  # one step of the running batch
    shape: tuple = ()
    last_step: float = 0.0  # the batch's start, then each step's report

    def begin(self, units: float, shape: tuple, now: float) -> None:
        """A batch reached the replica's critical path (it runs now)."""
        self.units, self.shape, self.last_step = units, shape, now

    def step(self, now: float) -> None:
        """A step of the running batch was reported: calibrate, and its shape is warm."""
        self.speed.sample(now - self.last_step, self.units)
        self.shapes.add(self.shape)
        self.last_step = now

    def restarted(self) -> None:
        """A new worker process: its shapes are cold again (its speed is the same hardware's)."""
        self.shapes.clear()

    def expected_step_s(self) -> float | None:
        return self.speed.seconds(self.units)

    def bound(self) -> tuple[float, str]:
        """Seconds without a step after which the running batch is stalled, and why that many."""
        if self.shape not in self.shapes:
            return self.first_step_timeout, "first step of this shape"
        expected = self.expected_step_s()
        if expected is None or STALL_FACTOR * expected <= self.stall_timeout:
            return self.stall_timeout, "stall timeout"
        return STALL_FACTOR * expected, f"{STALL_FACTOR:g} x its expected step of {expected:.2f}s"
