"""The multi-process executor with real worker processes (null stages: no torch)."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

from tests.conftest import drain_batch, wait_for, wait_until
from vllm_omni_like.config import FaultRule, StageConfig
from vllm_omni_like.errors import EngineDeadError, ErrorKind
from vllm_omni_like.executor import MultiprocExecutor
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.wire import (
    BatchDone,
    Denoised,
    ExecuteBatch,
    Progress,
    RequestResult,
    StageRequest,
)

FAULTS = (
    FaultRule("diffusion", "execute", "raise", match="@fail"),
    FaultRule("diffusion", "step", "exit", match="@exit"),
)


def _req(rid: str, prompt: str = "a cat", steps: int = 2, delay: float = 0.0) -> StageRequest:
    return StageRequest(
        rid, prompt, GenerationParams(seed=1, num_inference_steps=steps, step_delay=delay)
    )


def _results(msgs) -> dict[str, object]:
    return {m.output.request_id: m.output for m in msgs if isinstance(m, RequestResult)}


@pytest.fixture
def executor(no_leaked_children):
    with running(StageConfig(name="diffusion", kind="null"), FAULTS) as started:
        yield started


@contextlib.contextmanager
def running(config: StageConfig, faults: tuple[FaultRule, ...] = ()):
    """A started executor for `config`, its message sink and its deaths; shut down after."""
    sink: queue.Queue = queue.Queue()
    ex = MultiprocExecutor(config, 0, sink.put, faults)
    deaths: list = []
    ex.add_failure_callback(deaths.append)
    ex.start()
    try:
        yield ex, sink, deaths
    finally:
        ex.shutdown()


def _drain(sink: queue.Queue) -> list:
    """What the sink holds now (the reader threads joined at the death: nothing is on its way)."""
    msgs = []
    while not sink.empty():
        msgs.append(sink.get())
    return msgs


def test_batch_runs_end_to_end_with_progress(executor):
    ex, sink, _ = executor
    ex.execute(ExecuteBatch(1, [_req("a"), _req("b", "a dog")]))
    msgs = drain_batch(sink, 1)
    res = _results(msgs)
    assert set(res) == {"a", "b"} and all(o.error is None and o.images for o in res.values())
    assert sum(isinstance(m, Progress) for m in msgs) == 2
    done = msgs[-1]
    assert isinstance(done, BatchDone) and done.batch_size == 2 and done.model_batch_dim == 2
    assert ex.in_flight == set()


def test_the_next_batch_denoises_while_the_last_one_decodes(no_leaked_children):
    """Denoised(k) frees the main thread; batch k's results and BatchDone come from the finisher
    while batch k+1 steps; batches are finished in order (up to two pending: batch 2 leaves
    the critical path while batch 1 still decodes)."""
    config = StageConfig(name="diffusion", kind="null", options={"decode_delay": 0.6})
    with running(config) as (ex, sink, _):
        ex.execute(ExecuteBatch(1, [_req("a", steps=2, delay=0.05)]))
        ex.execute(ExecuteBatch(2, [_req("b", steps=3, delay=0.05)]))
        msgs = drain_batch(sink, 2, timeout=10)
        order = [(type(m).__name__, getattr(m, "batch_id", None)) for m in msgs]
        at = order.index
        assert at(("Denoised", 1)) < at(("Progress", 2)) < at(("RequestResult", 1))
        assert at(("RequestResult", 1)) < at(("BatchDone", 1)) < at(("RequestResult", 2))
        assert at(("Denoised", 2)) < at(("RequestResult", 2)) < at(("BatchDone", 2))
        # batch 2's three steps all ran during batch 1's 0.6 s decode
        steps_2 = [m for m in msgs if isinstance(m, Progress) and m.batch_id == 2]
        assert all(msgs.index(m) < at(("BatchDone", 1)) for m in steps_2) and len(steps_2) == 3
        assert set(_results(msgs)) == {"a", "b"} and ex.in_flight == set()
        assert sum(isinstance(m, Denoised) for m in msgs) == 2


def test_a_death_while_decoding_fails_both_batches_in_flight(no_leaked_children):
    faults = (FaultRule("diffusion", "output", "exit", match="@exit"),)
    config = StageConfig(name="diffusion", kind="null", options={"decode_delay": 0.2})
    with running(config, faults) as (ex, sink, deaths):
        ex.execute(ExecuteBatch(1, [_req("a", "x @exit", steps=1)]))
        ex.execute(ExecuteBatch(2, [_req("b", steps=50, delay=0.05)]))
        assert wait_until(lambda: deaths, 10)
        msgs = _drain(sink)
        # a's decode killed the worker while b was denoising: both are lost, listed once by
        # the death; no result and no BatchDone are made up for them
        assert _results(msgs) == {} and not any(isinstance(m, BatchDone) for m in msgs)
        assert sorted(deaths[0].in_flight) == ["a", "b"] and "exited with code 86" in (
            deaths[0].exit_desc
        )
        assert ex.in_flight == set()


def test_a_finisher_thread_that_dies_takes_the_worker_with_it(no_leaked_children):
    """Not a request's error: the worker exits at once (code 3) instead of hanging its batches."""
    config = StageConfig(name="diffusion", kind="tests.stage_helpers:FinisherCrashStage")
    with running(config) as (ex, sink, deaths):
        t0 = time.monotonic()
        ex.execute(ExecuteBatch(1, [_req("a", "x @crash-finisher", steps=1)]))
        assert wait_until(lambda: deaths, 5) and time.monotonic() - t0 < 2
        assert deaths[0].exit_desc == "exited with code 3" and deaths[0].in_flight == ["a"]
        msgs = _drain(sink)
        assert _results(msgs) == {} and not any(isinstance(m, BatchDone) for m in msgs)


def test_a_worker_freezes_what_its_load_made(no_leaked_children):
    """The load's objects (a compiled model's: about a million) are out of the collector's
    reach before the first request: a full collection would walk them inside a request."""
    config = StageConfig(name="diffusion", kind="tests.stage_helpers:HeapStage")
    with running(config) as (ex, sink, _):
        ex.execute(ExecuteBatch(1, [_req("a", steps=1)]))
        (out,) = _results(drain_batch(sink, 1)).values()
        assert out.error is None and int(out.text) >= 100_000  # its load's objects, frozen


def test_recoverable_fault_fails_only_its_own_request(executor):
    ex, sink, deaths = executor
    ex.execute(ExecuteBatch(2, [_req("a"), _req("b", "x @fail"), _req("c")]))
    res = _results(drain_batch(sink, 2))
    assert res["a"].error is None and res["c"].error is None
    assert res["b"].error.kind is ErrorKind.GENERATE
    assert res["b"].error.message.startswith(
        "stage 'diffusion': InjectedFault: injected raise fault at execute for request b (t="
    )
    assert ex.alive and deaths == []


def _kill_and_time(ex, sink, deaths, busy: bool):
    if busy:
        ex.execute(
            ExecuteBatch(
                3, [_req("slow", steps=1000, delay=0.01), _req("slow2", steps=1000, delay=0.01)]
            )
        )
        assert isinstance(sink.get(timeout=10), Progress)  # it is running
    pid = ex.pids[0]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    return t0


def test_sigkill_of_busy_worker_fails_in_flight_work_fast_and_fires_once(executor):
    ex, sink, deaths = executor
    t0 = _kill_and_time(ex, sink, deaths, busy=True)
    wait_for(lambda: deaths, 1, "the death reported")
    assert time.monotonic() - t0 < 0.1  # seen at once, its lost work listed in the event
    time.sleep(0.3)
    assert len(deaths) == 1
    assert deaths[0].exit_desc == "killed by signal SIGKILL"
    assert sorted(deaths[0].in_flight) == ["slow", "slow2"]
    assert not [m for m in _drain(sink) if isinstance(m, RequestResult | BatchDone)]
    assert not ex.alive and ex.in_flight == set()
    with pytest.raises(EngineDeadError, match="replica 0 is dead"):
        ex.execute(ExecuteBatch(4, [_req("late")]))


def test_sigkill_of_idle_worker_fires_the_callback_once(executor):
    ex, sink, deaths = executor
    t0 = _kill_and_time(ex, sink, deaths, busy=False)
    assert wait_until(lambda: len(deaths) == 1, 1)
    assert time.monotonic() - t0 < 0.5
    time.sleep(0.3)
    assert len(deaths) == 1 and deaths[0].in_flight == []
    assert sink.empty()


def test_worker_exit_fault_is_a_death_with_its_exit_code(executor):
    ex, sink, deaths = executor
    ex.execute(ExecuteBatch(5, [_req("p", "poison @exit")]))
    wait_for(lambda: deaths, 5, "the death reported")
    assert deaths[0].exit_desc == "exited with code 86" and deaths[0].in_flight == ["p"]
    assert not [m for m in _drain(sink) if isinstance(m, RequestResult | BatchDone)]


def test_fatal_device_error_makes_the_worker_exit(no_leaked_children):
    sink: queue.Queue = queue.Queue()
    config = StageConfig(name="diffusion", kind="tests.stage_helpers:DeviceErrorStage")
    ex = MultiprocExecutor(config, 0, sink.put)
    ex.start()
    deaths = []
    ex.add_failure_callback(deaths.append)
    ex.execute(ExecuteBatch(1, [_req("a"), _req("b", "device-error")]))
    wait_for(lambda: deaths, 5, "the death reported")
    assert deaths[0].exit_desc == "exited with code 3" and deaths[0].in_flight == ["a", "b"]
    ex.shutdown()


def test_abort_reaches_the_running_worker(executor):
    ex, sink, _ = executor
    ex.execute(
        ExecuteBatch(6, [_req("a", steps=500, delay=0.01), _req("b", steps=500, delay=0.01)])
    )
    assert isinstance(sink.get(timeout=10), Progress)
    ex.abort(["a", "b"])
    t0 = time.monotonic()
    msgs = drain_batch(sink, 6, timeout=5)
    assert time.monotonic() - t0 < 1.0
    assert _results(msgs) == {}  # aborted requests deliver nothing
    steps = [m.step for m in msgs if isinstance(m, Progress)]
    assert max(steps, default=0) < 100


def test_shutdown_is_idempotent_and_leaves_no_process(no_leaked_children):
    ex = MultiprocExecutor(
        StageConfig(name="s", kind="null", workers_per_replica=2), 0, lambda m: None
    )
    ex.start()
    pids = ex.pids
    assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    threads = [threading.Thread(target=ex.shutdown) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    ex.shutdown()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)


@pytest.mark.parametrize(
    ("config", "faults", "expected"),
    [
        (
            StageConfig(name="diffusion", kind="diffusion", model="/nonexistent/model"),
            (),
            "stage 'diffusion': replica 0: failed to load: FileNotFoundError: "
            "model directory '/nonexistent/model' does not exist",
        ),
        (
            StageConfig(name="llm", kind="null"),
            (FaultRule("llm", "load", "raise"),),
            "stage 'llm': replica 0: failed to load: InjectedFault: injected raise fault at load",
        ),
        (
            StageConfig(name="llm", kind="null"),
            (FaultRule("llm", "load", "exit"),),
            "stage 'llm': replica 0: worker 0 exited with code 86 while loading",
        ),
    ],
)
def test_startup_failures_name_stage_and_cause(config, faults, expected, no_leaked_children):
    ex = MultiprocExecutor(config, 0, lambda m: None, faults)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError) as info:
        ex.start()
    assert info.value.message.startswith(expected)
    assert time.monotonic() - t0 < 30


PARENT = textwrap.dedent("""
    import sys, time
    from vllm_omni_like.config import StageConfig
    from vllm_omni_like.executor import MultiprocExecutor
    if __name__ == "__main__":
        ex = MultiprocExecutor(StageConfig(name="s", kind="null", workers_per_replica=2), 0,
                               lambda m: None)
        ex.start()
        print(" ".join(map(str, ex.pids)), flush=True)
        time.sleep(120)
""")


def test_workers_exit_when_their_parent_is_sigkilled(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
        proc.kill()
        proc.wait(5)
        t0 = time.monotonic()
        gone = wait_until(lambda: not any(psutil.pid_exists(p) for p in pids), 10)
        assert gone, "workers outlived their parent"
        assert time.monotonic() - t0 < 10
    finally:
        proc.kill()
        proc.wait(5)
        proc.stdout.close()
