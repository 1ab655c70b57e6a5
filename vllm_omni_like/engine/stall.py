"""When a running batch counts as stalled: slow is not hung, and a hang is caught in every phase.

Each replica keeps a `StepClock`: the units of work of one step of the batch it runs (the cost
model of cost.py) and its measured seconds per unit (`Speed`), calibrated on every step
it reported. A running batch is stalled when no step arrived for

- while one of its workers says it compiles (`Compiling`: torch.compile's start and end, from
  every rank: a CFG-parallel rank 0 waits on rank 1's compile too): `compile_timeout`, counted
  from the compile's start; its end restarts the clock;
- on a replica that has measured no step yet (nor has the same stage's replica beside it on the
  same kind of device): `cold_timeout`, an allowance for a cold start that a busy machine does
  not trip;
- otherwise: `max(stall_timeout, STALL_FACTOR x the step's expected time)` at the measured
  speed, the first step of a shape the replica has not run included (no compile: no reason for
  it to take longer than any other step of its size),

so a worker whose steps are merely slow is never killed, while a hang on a fresh replica's first
batch, on a new shape or in the middle of a run is caught within its bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_omni_like.cost import Speed

STALL_FACTOR = 10.0  # a step may take this many times its expected time


@dataclass
class StepClock:
    """One replica's measured step speed, and the stall bound of the batch it runs now."""

    stall_timeout: float
    compile_timeout: float
    cold_timeout: float
    speed: Speed = field(default_factory=Speed)  # seconds per unit of work, measured
    units: float = 0.0  # one step of the running batch
    last_step: float = 0.0  # the batch's start, then each step's report (or a compile's end)
    compiling_ranks: set[int] = field(default_factory=set)  # its workers that compile now
    compiled: bool = False  # a compile ran since the last step (that step's time is no sample)

    def begin(self, units: float, now: float) -> None:
        """A batch reached the replica's critical path (it runs now)."""
        self.units, self.last_step, self.compiled = units, now, False

    def step(self, now: float) -> None:
        """A step of the running batch was reported: calibrate on it."""
        if not (self.compiling or self.compiled):  # a compiled step says nothing of the speed
            self.speed.sample(now - self.last_step, self.units)
        self.last_step, self.compiled = now, False

    @property
    def compiling(self) -> bool:
        return bool(self.compiling_ranks)

    def compile_state(self, rank: int, active: bool, now: float) -> None:
        """A worker (rank) began or ended a compilation: the clock counts from now."""
        if active:
            self.compiling_ranks.add(rank)
        else:
            self.compiling_ranks.discard(rank)
        self.last_step = now
        self.compiled = self.compiled or active

    def restarted(self) -> None:
        """A new worker process: it compiles nothing yet (its speed is the same hardware's)."""
        self.compiling_ranks.clear()
        self.compiled = False

    def expected_step_s(self, peer_rate: float | None = None) -> float | None:
        rate = self.speed.rate if self.speed.rate is not None else peer_rate
        return None if rate is None else rate * self.units

    def bound(self, peer_rate: float | None = None) -> tuple[float, str]:
        """Seconds without a step after which the running batch is stalled, and why that many
        (`peer_rate`: the speed a replica of the same stage on the same hardware measured)."""
        if self.compiling:
            return self.compile_timeout, "compiling"
        expected = self.expected_step_s(peer_rate)
        if expected is None:
            return self.cold_timeout, "cold start: no step measured yet"
        if STALL_FACTOR * expected <= self.stall_timeout:
            return self.stall_timeout, "stall timeout"
        return STALL_FACTOR * expected, f"{STALL_FACTOR:g} x its expected step of {expected:.2f}s"
