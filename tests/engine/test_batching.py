"""The batch policies (engine/batching.py): which requests go together, and when an idle
replica holds back; then both policies end to end on a null stage."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

from tests.conftest import wait_for
from tests.engine.helpers import engine, final, req
from vllm_omni_like.engine.batching import RefillHold, RequestLevel, take_compatible
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.wire import StageRequest


@dataclass
class _Key:
    key: str

    def batch_key(self, own_loop: frozenset[str] = frozenset()) -> str:
        return self.key


@dataclass
class _Queued:
    name: str
    key: str = "a"
    cohort: int | None = None
    enqueued_at: float = 0.0

    @property
    def staged(self) -> _Key:
        return _Key(self.key)


def _names(items) -> list[str]:
    return [i.name for i in items]


def test_take_compatible_batches_the_oldest_with_its_kind_and_keeps_the_order():
    waiting = deque(
        [_Queued("1"), _Queued("2", "b"), _Queued("3"), _Queued("4", cohort=1), _Queued("5")]
    )
    batch, left = take_compatible(waiting, max_batch=8)
    assert _names(batch) == ["1", "3", "5"] and _names(left) == ["2", "4"]
    suspects = [_Queued("x", cohort=3), _Queued("y"), _Queued("z", "b", cohort=3)]
    suspects += [_Queued("w", cohort=4), _Queued("v", cohort=3)]
    batch, left = take_compatible(deque(suspects), 8)
    # re-queued after a death: with its cohort only (whatever the shapes: they were one batch)
    assert _names(batch) == ["x", "z", "v"] and _names(left) == ["y", "w"]
    batch, left = take_compatible(deque(suspects), 2)
    assert _names(batch) == ["x", "z"] and _names(left) == ["y", "w", "v"]
    batch, left = take_compatible(deque(_Queued(str(i)) for i in range(5)), max_batch=2)
    assert _names(batch) == ["0", "1"] and _names(left) == ["2", "3", "4"]


def test_refill_holds_for_the_clients_of_the_last_batch():
    policy = RefillHold(max_batch=8, share=0.5)
    assert not policy.hold(0, [], 0.0)  # an idle stage takes a new request at once
    policy.batch_done(0, size=4, started=10.0, now=12.0, waiting=1)  # ran 2 s: wait up to 1 s
    assert policy.hold(0, [_Queued("a")] * 3, 12.5)  # 5 expected back, 3 queued
    assert not policy.hold(0, [_Queued("a")] * 5, 12.5)  # all back
    policy.batch_done(0, size=4, started=10.0, now=12.0, waiting=0)
    assert not policy.hold(0, [_Queued("a")], 13.0)  # the window closed
    policy.denoised(1, size=3, waiting=0)  # decoding: held until its results are out
    assert policy.hold(1, [_Queued("a")], 1e9)
    policy.forget(1)  # died: nothing held for it
    assert not policy.hold(1, [_Queued("a")], 0.0)
    never = RefillHold(max_batch=8, share=0.0)
    never.denoised(0, size=4, waiting=0)
    never.batch_done(0, size=4, started=0.0, now=5.0, waiting=0)
    assert not never.hold(0, [_Queued("a")], 5.0)


def test_refill_a_hold_ends_only_for_the_replica_that_takes_the_batch():
    """Replicas share one queue: when it reaches what two holding replicas wait for, one takes
    it and the other keeps waiting for its own clients (it used to stop holding as well and
    take the next request that came back alone: a batch split with 4 replicas)."""
    policy = RefillHold(max_batch=4, share=0.5)
    policy.batch_done(0, size=4, started=0.0, now=2.0, waiting=0)
    policy.batch_done(1, size=4, started=0.0, now=2.0, waiting=0)
    full = [_Queued("a")] * 4
    assert not policy.hold(0, full, 2.1) and not policy.hold(1, full, 2.1)
    policy.took(0)  # replica 0 took the four
    assert policy.hold(1, [_Queued("b")], 2.2)  # replica 1 still waits for its four
    assert not policy.hold(0, [_Queued("b")], 2.2)  # replica 0's hold is over
    assert not policy.hold(1, [_Queued("b")], 3.0)  # until its window closes


def test_request_level_waits_from_the_oldest_for_a_full_batch():
    policy = RequestLevel(max_batch=4, max_wait=0.2)
    queued = [_Queued(str(i), enqueued_at=10.0) for i in range(3)]
    assert policy.hold(0, queued, 10.1)  # 3 of 4, the oldest waited 0.1 s
    assert not policy.hold(0, queued, 10.25)  # the oldest waited its 0.2 s
    assert not policy.hold(0, [*queued, _Queued("4", enqueued_at=10.15)], 10.16)  # full
    assert not RequestLevel(max_batch=4, max_wait=0.0).hold(0, queued, 10.0)


def _spaced(e, n: int, gap: float, steps: int = 2):
    async def run():
        jobs = []
        for i in range(n):
            jobs.append(
                asyncio.ensure_future(final(e, req(f"s{i}", pipeline="null-image", steps=steps)))
            )
            await asyncio.sleep(gap)
        return await asyncio.gather(*jobs)

    return asyncio.run(run())


def test_request_policy_gathers_requests_that_arrive_apart_into_one_batch():
    kw = {"max_batch_size": 4, "batch_policy": "request", "batch_max_wait": 1.0}
    with engine("null-image", stage_kw=kw) as e:
        outs = _spaced(e, 4, gap=0.05)
        assert all(o.ok for o in outs)
        wait_for(lambda: e.stats.snapshot()["batch_sizes"] == {4: 1}, 5, "one batch of 4")


def test_request_policy_runs_a_lone_request_after_its_max_wait():
    kw = {"max_batch_size": 4, "batch_policy": "request", "batch_max_wait": 0.4}
    with engine("null-image", stage_kw=kw) as e:
        t0 = time.monotonic()
        (out,) = _spaced(e, 1, gap=0.0)
        took = time.monotonic() - t0
        assert out.ok and 0.4 <= took < 2.0, took


def test_without_a_wait_requests_that_arrive_apart_run_as_they_come():
    kw = {"max_batch_size": 4, "batch_policy": "request", "batch_max_wait": 0.0}
    with engine("null-image", stage_kw=kw) as e:
        outs = _spaced(e, 4, gap=0.3)
        assert all(o.ok for o in outs)
        wait_for(lambda: e.stats.snapshot()["batch_sizes"] == {1: 4}, 5, "four batches of 1")


def test_in_a_mode_our_own_loop_runs_only_the_shapes_keep_requests_apart():
    def request(mode="text2img", **params):
        return StageRequest("r", "a cat", GenerationParams(**params), mode=mode)

    own = frozenset({"text2img"})
    plain = request(width=64, height=64)
    others = [
        request(width=64, height=64, num_inference_steps=7),
        request(width=64, height=64, guidance_scale=1.0, negative_prompt="blur"),
        request(width=64, height=64, scheduler="euler-a", seed=3),
    ]
    for other in others:  # each row has its own steps, guidance, scheduler and seed
        assert other.batch_key(own) == plain.batch_key(own)
        assert other.batch_key() != plain.batch_key()  # the pipeline's call: one step loop
    assert request(width=32, height=64).batch_key(own) != plain.batch_key(own)
    edit = request("edit", width=64, height=64, num_inference_steps=7)
    assert edit.batch_key(own) != request("edit", width=64, height=64).batch_key(own)
