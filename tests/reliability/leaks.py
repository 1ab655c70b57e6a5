"""What every scenario checks afterwards: processes, /dev/shm, fds, tasks, engine maps, metrics."""

from __future__ import annotations

import asyncio
import os

import psutil

from tests.conftest import live_children, wait_until


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


class Baseline:
    """Taken before a scenario; `check` asserts that everything went back to it."""

    def __init__(self) -> None:
        self.shm = shm_entries()
        self.fds = psutil.Process().num_fds()

    def check(self, fd_slack: int = 0) -> None:
        """After the server stopped: no child process, no /dev/shm growth, fds at baseline."""
        assert wait_until(lambda: not live_children(), 10), f"processes left: {live_children()}"
        assert shm_entries() <= self.shm, f"leaked /dev/shm: {shm_entries() - self.shm}"
        assert wait_until(lambda: psutil.Process().num_fds() <= self.fds + fd_slack, 5), (
            f"fds {psutil.Process().num_fds()} > baseline {self.fds}"
        )


def check_engine(server) -> None:
    """The server is still up: no request state and no stray task may remain."""
    engine = server.engine
    orch = engine.orchestrator
    assert wait_until(lambda: not orch.requests, 5), f"requests left: {list(orch.requests)}"
    assert all(not p.waiting for pools in orch.pools.values() for p in pools)
    assert wait_until(
        lambda: all(
            not r.inflight for pools in orch.pools.values() for p in pools for r in p.replicas
        ),
        5,
    )
    assert not orch.early_aborts
    # no request id left in the engine, and no success whose store was never reported
    assert wait_until(lambda: len(orch.ledger) == 0, 5), f"ids left: {len(orch.ledger)}"
    snap = engine.stats.snapshot()
    assert sum(snap["final"].values()) == snap["requests_total"], snap
    loop = server.app.state.loop
    idle = server.idle_tasks + len(server.app.state.server.videos.running)
    assert wait_until(lambda: task_count(loop) <= idle, 5), (
        f"asyncio tasks {task_count(loop)} > idle {idle}"
    )


def task_count(loop) -> int:
    return len([t for t in asyncio.all_tasks(loop) if not t.done()])


def client_of(engine_id: str) -> str:
    """The engine keys a request on `<x-request-id>~<token>`: the client's id, back."""
    return engine_id.split("~")[0]


def statuses(server, ids) -> dict[str, str]:
    final = {client_of(k): v for k, v in list(server.engine.orchestrator.recent_final.items())}
    return {rid: final.get(rid) for rid in ids}
