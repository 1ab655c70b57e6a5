"""What a replica's death does to the requests it held: re-run, fail, and who pays for it.

- Requests lost in a death are re-queued from the failed stage (earlier stages' outputs
  reused), each to run alone first (`isolate`), unless `after_death` says they end here.
- A request that was present at an earlier death and kills its worker again while running
  alone is proven poison: this death, and its first one, are charged to it rather than to the
  replicas' restart budgets, and the other requests of its first death, innocent now, run
  together again at once instead of one by one.
"""

from __future__ import annotations

import itertools

from vllm_omni_like.engine.request_state import RequestState, after_death
from vllm_omni_like.engine.stage_pool import StagePool
from vllm_omni_like.messages import ReplicaDied

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


def proven_poison(lost: list[RequestState]) -> RequestState | None:
    """The culprit, when the death happened while it ran alone after an earlier death."""
    if len(lost) == 1 and lost[0].deaths >= 1 and lost[0].isolate:
        return lost[0]
    return None


def settle(
    lost: list[RequestState],
    pool: StagePool,
    event: ReplicaDied,
    max_retries: int,
    finish,
) -> None:
    """Each lost request: ended by `finish(state, error)` or re-queued to run alone first."""
    group = next(_groups)
    for state in lost:
        state.deaths += 1
        if state.deaths == 1:
            state.first_death, state.death_group = (pool, state.replica), group
        verdict = after_death(state, pool.name, pool.state, event.exit_desc, max_retries)
        if verdict is not None:
            finish(state, verdict)
            continue
        state.retries += 1
        state.replica, state.isolate = None, True
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
