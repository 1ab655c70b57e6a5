"""Which replica of a stage gets the next batch.

- `cost` (the default): the replica where the batch would end first: the work it holds on its
  critical path plus the batch's, in seconds at the replica's own measured speed (in units of
  work while some replica is not measured yet, so replicas compare on the same scale);
- `count`: the replica holding the fewest requests (what request-count routers do; kept to
  compare with).

Ties go to the replica that was given work least recently. Routing matters where replicas hold
queued work (`--replica-queue`) or differ in speed; with one credit each and equal replicas,
every free replica is idle and any choice is the same.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm_omni_like.engine.replica import Replica


def choose(free: Sequence[Replica], units: float, how: str) -> Replica:
    """The replica of `free` (live, with a credit) that takes a batch of `units` of work."""
    if how == "count":
        return min(free, key=lambda r: (r.outstanding()[0], r.last_dispatch))
    rates = [r.clock.speed.rate for r in free]
    measured = all(rates)

    def ends(r: Replica) -> float:
        held = r.outstanding()[1] + units
        rate = r.clock.speed.rate
        return held * rate if measured and rate is not None else held

    return min(free, key=lambda r: (ends(r), r.last_dispatch))
