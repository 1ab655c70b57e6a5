"""The one running-set policy: which group of requests may step in a replica's running set now,
in which lane, under which row and work budget. The engine (`Replica.joinable`: how many queued
requests it sends a busy replica as a join) and the worker (`RunningSet`: whether a group that
arrives, or waits, steps now) both ask this object, each with the groups it sees ahead of the
group; nothing else models lanes or budgets.

- A set holds at most `budget` requests (`--max-batch-size`, rows still stepping: a request
  whose rows ended is free at once, though its decode may wait for its decode group), in at
  most `lanes` shape groups (`--shape-groups`; a shape group is `StageRequest.batch_key` of the
  stepped modes), and a lane's step does at most the work of `budget` requests of the joining
  group's first (cost.py units; a request of n images is n rows of work).
- A group of a mode that does not step rows (a *whole* batch) runs alone: it starts only on an
  empty set, and while one is ahead nothing joins (so no join waits behind it at the worker).
- With nothing ahead any group starts a set (the engine batched it; an idle replica takes it).

Why one policy asked by both sides, rather than the engine deciding and the worker obeying:
the engine already decides joins and the worker already decides, when a group arrives, whether
it steps now or waits (a group sent ahead with `--replica-queue` is queued at the worker, whose
place only the worker knows), so orders alone would still leave the worker a rule of its own
(and need a second message to release a queued group). Asking one pure function on both sides
is the smaller change, and the two views are ordered. The engine counts ahead of a join every
group on the replica's critical path (sent, not yet `Denoised`), those sent ahead that no step
report has named yet included; the worker counts the groups in its set and those waiting. So
the worker sees, ahead of a group, a subset of what the engine saw when it sent it (groups
sent before it, less some that left: a group leaves the worker before its `Denoised` reaches
the engine), each with no more rows still stepping (the engine frees a row when a step report
says it ended, after the worker did). `room` never shrinks when groups ahead go or their rows
or work shrink (`fsum`: the order of the terms cannot round it up), so a join the engine sends
always finds room at the worker; only a group sent ahead may wait there, and the worker says
so (`wire.Held`); the engine counts it as stepping once a step report names it.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from vllm_omni_like import cost
from vllm_omni_like.config import StageConfig
from vllm_omni_like.params import GenerationParams


@dataclass(frozen=True)
class GroupLoad:
    """One group (an `ExecuteBatch`) as the policy sees it: in the set or ahead in the queue."""

    key: Hashable  # its shape group
    whole: bool  # its mode does not step rows: it runs alone
    requests: int  # its requests, as sent
    rows: int  # those whose rows still step
    units: float  # the work of one step of all its requests (cost.py)

    @property
    def step_units(self) -> float:
        """The work of one step of its rows still stepping."""
        return self.units * self.rows / self.requests if self.requests else 0.0


@dataclass(frozen=True)
class JoinPolicy:
    lanes: int  # shape groups side by side (`--shape-groups`)
    budget: int  # requests in the set (`--max-batch-size`); a lane's work: that many's
    text: bool = False  # a text stage: a request's step is one unit (cost.py)

    @classmethod
    def of(cls, config: StageConfig) -> JoinPolicy:
        text = config.kind == "llm" or getattr(config.options, "output", None) == "text"
        return cls(config.shape_groups, config.max_batch_size, text)

    def units(self, params: GenerationParams) -> float:
        """The work of one step of one request (the cost model's, for this stage)."""
        return cost.step_units(params, self.text)

    def room(self, ahead: Sequence[GroupLoad], key: Hashable, units: Sequence[float]) -> int:
        """How many of the leading requests of shape group `key`, of `units` of work a step
        each (in order), may join a set with the groups `ahead` (0: none; none either with
        nothing ahead: there is no set to join)."""
        if not ahead or any(g.whole for g in ahead):
            return 0
        if len({g.key for g in ahead} | {key}) > self.lanes:
            return 0
        rows = self.budget - sum(g.rows for g in ahead)
        lane = math.fsum(g.step_units for g in ahead if g.key == key)
        work = self.budget * units[0] - lane if units else 0.0
        taken = 0
        for u in units[: max(0, rows)]:
            if u > work:
                break
            work -= u
            taken += 1
        return taken

    def admits(self, ahead: Sequence[GroupLoad], group: GroupLoad, units: Sequence[float]) -> bool:
        """Whether `group` (its requests' `units`, in order) may step now: with nothing ahead
        any group starts a set; else a group of rows that all fit `room`."""
        if not ahead:
            return True
        return not group.whole and self.room(ahead, group.key, units) >= len(units)
