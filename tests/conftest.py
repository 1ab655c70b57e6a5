"""Shared fixtures and helpers: real worker processes, bounded waits, leak checks."""

from __future__ import annotations

import queue
import time

import psutil
import pytest

from vllm_omni_like.executor.process_life import WORKER_NAME
from vllm_omni_like.wire import BatchDone


def drain_batch(q: queue.Queue, batch_id: int, timeout: float = 30.0) -> list[object]:
    """Messages from an executor sink until `batch_id` is done (bounded by `timeout`)."""
    got: list[object] = []
    deadline = time.monotonic() + timeout
    while True:
        msg = q.get(timeout=max(0.01, deadline - time.monotonic()))
        got.append(msg)
        if isinstance(msg, BatchDone) and msg.batch_id == batch_id:
            return got


def wait_until(predicate, timeout: float, interval: float = 0.02) -> bool:
    """True as soon as `predicate()` holds; False if it still does not after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def wait_for(predicate, timeout: float, what: str = "the condition", interval: float = 0.02):
    """The suite's one wait for an event: returns `predicate()`'s truthy value as soon as it
    has one, or fails the test saying what did not happen within `timeout` seconds. A test
    that reads a counter or a state the engine changes on another thread waits with this."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def mp_role(p: psutil.Process) -> str:
    """What process `p` is to the executor: "tracker" (multiprocessing's resource tracker),
    "forkserver" (its fork server, executor/start_method.py), "worker" (a stage worker, spawned
    or forked), or "" (anything else)."""
    cmd = " ".join(p.cmdline())
    if "resource_tracker" in cmd:
        return "tracker"
    if p.name() == WORKER_NAME or "spawn_main" in cmd:
        return "worker"
    return "forkserver" if "multiprocessing.forkserver" in cmd else ""


def live_children() -> list[psutil.Process]:
    """Child processes, less multiprocessing's own resource tracker and fork server (one per
    parent, by design)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if mp_role(child) in ("tracker", "forkserver") or child.status() == "zombie":
                continue
        except psutil.NoSuchProcess:
            continue
        found.append(child)
    return found


@pytest.fixture
def no_leaked_children():
    """After the test, this process has no child processes left."""
    yield
    assert wait_until(lambda: not live_children(), 10), live_children()
