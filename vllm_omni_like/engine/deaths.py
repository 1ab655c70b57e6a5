"""What a replica's death does to the requests it held: re-run, fail, and who pays for it.

- A death is charged to the requests that may have caused it: all it held, unless the engine
  killed the replica for a stall, which names its batch (the one whose decode hung, or the one
  whose step did): a batch that denoised beside a hung decode, or waited behind a hung step,
  re-runs without a charge.
- The charged requests are suspects. They are re-queued from the failed stage (earlier stages'
  outputs reused) as two **cohorts**, the halves of each shape group they held: a cohort runs
  as one batch, alone on its replica (nothing runs or joins beside it), so that a death while
  it runs is its own. A cohort that dies is halved again; one that ends its stage is cleared.
  So a set of 32 with one poison row costs log2(32) more deaths of ever smaller batches, not
  32 runs of one.
- A death while a cohort ran is the bisection's, not the replica's: its restart is not counted
  (the bisection bounds them: each halves a cohort or convicts) and waits the first back-off
  step only, which it does not grow.
- A cohort of one that dies is **convicted**: it fails, every death of its chain (those it was
  present at since it last ran clean) is refunded to the replicas' restart budgets, and every
  waiting suspect whose chain those deaths explain is cleared: it runs as any request again.
- A request's retry budget (`--max-request-retries`) is charged once a chain, at its first death;
  a bisection does not spend it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from vllm_omni_like.engine.replica import Stall
from vllm_omni_like.engine.request_state import RequestState, after_death
from vllm_omni_like.engine.stage_pool import StagePool
from vllm_omni_like.errors import DeathCause, OmniError
from vllm_omni_like.wire import Mode, ReplicaDied


def lost_requests(
    requests: dict[str, RequestState], pool: StagePool, replica: int, event: ReplicaDied
) -> list[RequestState]:
    """The live requests the dead replica held for this pool."""
    found = []
    for rid in event.in_flight:
        state = requests.get(rid)
        if state is None or state.finished or state.replica != replica:
            continue
        if state.pool is pool:
            found.append(state)
    return found


def charged(lost: list[RequestState], stall: Stall | None) -> list[RequestState]:
    """The lost requests a death is charged to: the stalled batch's, else every one."""
    if stall is None:
        return lost
    return [s for s in lost if s.request_id in stall.request_ids]


def convicted(charged: list[RequestState]) -> RequestState | None:
    """The culprit, when the death happened while it ran as a cohort of one."""
    if len(charged) == 1 and charged[0].cohort is not None:
        return charged[0]
    return None


def halves(suspects: list[RequestState], own_loop: frozenset[Mode]) -> list[list[RequestState]]:
    """The cohorts `suspects` re-run as: the two halves of each shape group (in their order)."""
    groups: dict[tuple[object, ...], list[RequestState]] = {}
    for state in suspects:
        groups.setdefault(state.staged.batch_key(own_loop), []).append(state)
    cohorts = []
    for group in groups.values():
        mid = (len(group) + 1) // 2
        cohorts += [c for c in (group[:mid], group[mid:]) if c]
    return cohorts


KEPT = 1024  # charged deaths remembered for a refund (a replica's budget refills in 30 s anyway)


class DeathBook:
    """The deaths a replica's restart budget was charged for, by id, until a conviction
    refunds them; and the ids of cohorts."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._charged: dict[int, tuple[StagePool, int]] = {}

    def record(self, pool: StagePool, replica: int, guilty: list[RequestState]) -> bool:
        """A death, added to the chain of each request charged with it; whether the replica's
        restart budget pays for it (not when a cohort ran: the bisection's death). A charged
        one is remembered until a conviction refunds it."""
        death = next(self._ids)
        for state in guilty:
            state.chain.add(death)
        charged = not any(s.cohort is not None for s in guilty)
        if charged:
            self._charged[death] = (pool, replica)
            if len(self._charged) > KEPT:  # the oldest: its replica's budget refilled long ago
                del self._charged[next(iter(self._charged))]
        return charged

    def cohort(self) -> int:
        return next(self._ids)

    def absolve(self, culprit: RequestState, pools: list[StagePool]) -> None:
        """The culprit's chain of deaths is refunded; the waiting suspects it explains (every
        death of their chain is one of its own) are cleared."""
        explained = culprit.chain
        for death in explained:
            charged = self._charged.pop(death, None)
            if charged is not None:
                charged[0].refund(charged[1])
        for pool in pools:
            for state in pool.waiting:
                if state.cohort is not None and state.chain <= explained:
                    state.cohort, state.chain = None, set()

    def settle(
        self,
        lost: list[RequestState],
        guilty: list[RequestState],
        pool: StagePool,
        event: ReplicaDied,
        stall: Stall | None,
        max_retries: int,
        finish: Callable[[RequestState, OmniError], None],
    ) -> None:
        """Each lost request: ended by `finish(state, error)` or re-queued at the front (the
        `guilty`, whose chains hold this death already, as new cohorts; the others as they
        ran)."""
        cause = DeathCause.CRASHED if stall is None else DeathCause.STALLED
        detail = event.exit_desc if stall is None else stall.reason
        charge, culprit = {id(s) for s in guilty}, convicted(guilty)
        suspects: list[RequestState] = []
        for state in lost:
            charged = id(state) in charge
            state.deaths += charged
            verdict = after_death(
                state, pool.name, pool.state, cause, detail, max_retries, charged, state is culprit
            )
            if verdict is not None:
                finish(state, verdict)
                continue
            state.replica = None
            if charged:
                state.retries += state.cohort is None  # a chain's first death spends a retry
                suspects.append(state)
            else:
                pool.enqueue(state, front=True)
        for cohort in reversed(halves(suspects, pool.own_loop)):
            number = self.cohort()
            for state in reversed(cohort):
                state.cohort = number
                pool.enqueue(state, front=True)
