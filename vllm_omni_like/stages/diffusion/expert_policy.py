"""Which expert a running set steps next under `--offload idle-expert` (offload.py keeps one of a
two-expert model's denoisers on the device, the other in host memory).

A row needs the expert of its timestep (the high-noise `transformer` at or above the boundary,
`transformer_2` below it: the adapter's own rule, `Adapter.expert_for`). Each step runs one
expert's rows; the rows that need the other expert wait. The resident expert keeps stepping its
rows until none needs it (then the swap), or until rows of the other expert have waited
`max_wait` steps (then the swap, and the rows left on the old side wait in turn): a set fed new
high-noise rows every step still steps its low-noise rows, so no row waits more than `max_wait`
of the set's steps for its expert. A set whose rows all need the other expert swaps at once.

The policy is pure (numbers in, numbers out): the set calls `choose` before a step and `after`
once the step is committed; `upcoming` says whether the next step will swap, so the first
blocks of the next expert can be copied during this step (offload.py `prefetch`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

HIGH, LOW = 0, 1  # the experts' order: the high-noise one first (Adapter.experts)
# steps the rows of the expert not on the device may wait while the resident one's step
MAX_WAIT_STEPS = 4


def choose(resident: int | None, needs: Sequence[int], waited: int, max_wait: int) -> int:
    """The expert that steps next: the resident one while a row needs it and the others have
    waited fewer than `max_wait` steps; else the other (none resident: the one most rows need,
    the high-noise one on a tie). `needs` is not empty."""
    mine = sum(1 for n in needs if n == resident)
    if resident is None or mine == 0:
        low = sum(1 for n in needs if n == LOW)
        return LOW if low > len(needs) - low else HIGH
    if mine == len(needs) or waited < max_wait:
        return resident
    return 1 - resident


def after(resident: int | None, chosen: int, needs: Sequence[int], waited: int) -> int:
    """The steps the other expert's rows have waited once `chosen` stepped (`needs`: the rows'
    before the step): counted from the swap, zero while none waits."""
    if chosen != resident:
        waited = 0
    return waited + 1 if any(n != chosen for n in needs) else 0


@dataclass
class SwapPolicy:
    """The set's count of waited steps (`choose` / `after` above)."""

    max_wait: int = MAX_WAIT_STEPS
    waited: int = 0

    def choose(self, resident: int | None, needs: Sequence[int]) -> int:
        return choose(resident, needs, self.waited, self.max_wait)

    def upcoming(
        self, resident: int | None, chosen: int, needs: Sequence[int], next_needs: Sequence[int]
    ) -> int | None:
        """The expert the step after this one swaps to (None: no swap): `next_needs` are the
        rows' needs once `chosen`'s rows stepped (a row that ends: left out)."""
        if not next_needs:
            return None
        waited = after(resident, chosen, needs, self.waited)
        nxt = choose(chosen, next_needs, waited, self.max_wait)
        return None if nxt == chosen else nxt

    def stepped(self, resident: int | None, chosen: int, needs: Sequence[int]) -> None:
        self.waited = after(resident, chosen, needs, self.waited)
