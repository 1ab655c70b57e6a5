"""What a replica's death does to the requests it held: re-run, fail, and who pays for it.

- A death is charged to the requests that may have caused it: all it held, unless the engine
  killed the replica for a stall, which names its batch (the one whose decode hung, or the one
  whose step did): a batch that denoised beside a hung decode, or waited behind a hung step,
  re-runs without a charge.
- Charged requests are re-queued from the failed stage (earlier stages' outputs reused), each
  to run alone first (`isolate`: a batch of one, with nothing else in flight on its replica,
  so that a second death is its own), unless `after_death` says they end here.
- A request that was present at an earlier death and kills its worker again while running
  alone is proven poison: this death, and its first one, are charged to it rather than to the
  replicas' restart budgets, and the other requests of its first death, innocent now, run
  together again at once instead of one by one.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from vllm_omni_like.engine.replica import Stall
from vllm_omni_like.engine.request_state import RequestState, after_death
from vllm_omni_like.engine.stage_pool import StagePool
from vllm_omni_like.errors import DeathCause, OmniError
from vllm_omni_like.wire import ReplicaDied

_groups = itertools.count(1)


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


def proven_poison(charged: list[RequestState]) -> RequestState | None:
    """The culprit, when the death happened while it ran alone after an earlier death."""
    if len(charged) == 1 and charged[0].deaths >= 1 and charged[0].isolate:
        return charged[0]
    return None


def settle(
    lost: list[RequestState],
    pool: StagePool,
    event: ReplicaDied,
    stall: Stall | None,
    max_retries: int,
    finish: Callable[[RequestState, OmniError], None],
) -> None:
    """Each lost request: ended by `finish(state, error)` or re-queued (a charged one to run
    alone first; one the death is not charged to as it ran)."""
    group = next(_groups)
    guilty = {id(s) for s in charged(lost, stall)}
    cause = DeathCause.CRASHED if stall is None else DeathCause.STALLED
    detail = event.exit_desc if stall is None else stall.reason
    for state in lost:
        charge = id(state) in guilty
        if charge:
            state.deaths += 1
            if state.deaths == 1:
                state.first_death, state.death_group = (pool, state.replica), group
        verdict = after_death(state, pool.name, pool.state, cause, detail, max_retries, charge)
        if verdict is not None:
            finish(state, verdict)
            continue
        state.retries += charge
        state.replica, state.isolate = None, state.isolate or charge
        pool.enqueue(state, front=True)


def absolve(culprit: RequestState, pools: list[StagePool]) -> None:
    """The culprit's first death is refunded; its neighbours of then no longer run alone."""
    if culprit.first_death is not None:
        first_pool, replica = culprit.first_death
        first_pool.refund(replica)
    for pool in pools:
        for state in pool.waiting:
            if state is not culprit and state.death_group == culprit.death_group:
                state.isolate = False
