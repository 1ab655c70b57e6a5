"""How an executor sorts its workers' messages (executor/inbound.py), whatever carries them."""

from __future__ import annotations

from vllm_omni_like.executor.inbound import Inbound
from vllm_omni_like.outputs import StageOutput
from vllm_omni_like.wire import BatchDone, Progress, RequestResult, WorkerReady


def _result(batch_id: int, rid: str) -> RequestResult:
    return RequestResult(batch_id, StageOutput(request_id=rid, stage="s"))


def test_results_of_requests_in_flight_reach_the_owner_once_and_a_death_takes_the_rest():
    got: list[object] = []
    inbound = Inbound(got.append)
    inbound.route(WorkerReady(0, 123, "cpu"))
    assert inbound.startup.get_nowait() == WorkerReady(0, 123, "cpu") and got == []
    inbound.sent(1, {"a", "b"})
    inbound.sent(2, {"c"})
    inbound.route(Progress(1, ["a", "b"], 1, 4))
    inbound.route(_result(1, "a"))
    inbound.route(_result(1, "a"))  # a second copy
    inbound.route(_result(1, "zz"))  # never this replica's
    assert [type(m).__name__ for m in got] == ["Progress", "RequestResult"]
    assert inbound.requests == {"b", "c"}
    inbound.route(BatchDone(1, 2, 2, 0.1))  # b ended without a result (aborted)
    assert inbound.requests == {"c"} and isinstance(got[-1], BatchDone)
    assert inbound.lost() == ["c"] and inbound.requests == set()
    inbound.route(_result(2, "c"))  # after the death listed it: dropped
    assert len(got) == 3
