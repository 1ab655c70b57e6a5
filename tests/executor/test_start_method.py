"""How workers start (executor/start_method.py): a torch stage on the CPU forks from the fork
server that imported torch once; a null stage, or one that may use CUDA, spawns."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import psutil
import pytest

from tests.conftest import mp_role, wait_for
from tests.engine.helpers import engine, final, req
from vllm_omni_like.config import StageConfig
from vllm_omni_like.executor import start_method
from vllm_omni_like.executor.process_life import WORKER_NAME
from vllm_omni_like.stages.trace import TRACE_BATCHES_ENV, TRACE_DIR_ENV

CPU = {"device": "cpu"}


def _stage(kind: str = "diffusion") -> StageConfig:
    return StageConfig(name="s", kind=kind)


@pytest.mark.parametrize(
    ("kind", "devices", "gpu", "expected"),
    [
        ("diffusion", ("cpu",), True, "forkserver"),  # told the CPU: no CUDA to inherit
        ("diffusion", ("auto",), False, "forkserver"),
        ("diffusion", ("auto",), True, "spawn"),  # auto on a GPU host may start CUDA
        ("diffusion", ("cuda:1",), False, "spawn"),
        ("llm", ("cpu", "cuda:0"), False, "spawn"),  # any rank on a GPU: every rank spawns
        ("null", ("cpu",), False, "spawn"),  # imports no torch: nothing to preload
    ],
)
def test_the_start_method_follows_the_stage_and_its_devices(
    monkeypatch, kind, devices, gpu, expected
):
    monkeypatch.delenv(start_method.START_ENV, raising=False)
    monkeypatch.setattr(start_method, "host_has_gpu", lambda: gpu)
    assert start_method.method_for(_stage(kind), devices) == expected


def test_the_environment_overrides_the_start_method_and_refuses_an_unknown_one(monkeypatch):
    monkeypatch.setattr(start_method, "host_has_gpu", lambda: False)
    monkeypatch.setenv(start_method.START_ENV, "spawn")
    assert start_method.method_for(_stage(), ("cpu",)) == "spawn"
    monkeypatch.setenv(start_method.START_ENV, "fork")
    with pytest.raises(ValueError, match="VLLM_OMNI_LIKE_WORKER_START='fork': expected one of"):
        start_method.method_for(_stage(), ("cpu",))


def _worker(eng) -> psutil.Process:
    pid = eng.orchestrator.pools["tiny-image"][0].replicas[0].executor.pids[0]
    return psutil.Process(pid)


def _image(eng) -> np.ndarray:
    r = req("a", "a red circle", "tiny-image", steps=2, seed=3, width=64, height=64)
    out = asyncio.run(final(eng, r))
    assert out.ok, out.error
    return out.result.images[0].pixels


@pytest.mark.drill  # (three engine starts: ~22 s; every CPU worker forks from it anyway)
def test_a_cpu_worker_forks_from_the_fork_server_with_the_engines_environment(
    monkeypatch, tmp_path
):
    monkeypatch.delenv(start_method.START_ENV, raising=False)
    monkeypatch.setattr(start_method, "host_has_gpu", lambda: False)
    monkeypatch.delenv(TRACE_DIR_ENV, raising=False)
    with engine("tiny-image", stage_kw=CPU) as eng:  # (the fork server runs from here on)
        worker = _worker(eng)
        server = worker.parent()
        assert worker.name() == WORKER_NAME and mp_role(worker) == "worker"
        assert server is not None and mp_role(server) == "forkserver"
        assert server.ppid() == os.getpid()
        forked = _image(eng)
    # set after the fork server started: a worker forked now still sees it (it writes its
    # timeline where the variable says), and writes its log to the engine's stderr of now
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(TRACE_BATCHES_ENV, "")
    log = tmp_path / "stderr.txt"
    saved = os.dup(2)
    try:
        with open(log, "w") as f:
            os.dup2(f.fileno(), 2)
        t0 = time.monotonic()
        with engine("tiny-image", stage_kw=CPU) as eng:
            started = time.monotonic() - t0
            assert _worker(eng).parent().pid == server.pid  # the same fork server serves it
            assert np.array_equal(_image(eng), forked)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    assert (tmp_path / "diffusion-rank0-timeline.jsonl").exists(), list(tmp_path.iterdir())
    assert "[diffusion:0] INFO stage diffusion: attention sdpa" in log.read_text()
    monkeypatch.setenv(start_method.START_ENV, "spawn")
    monkeypatch.delenv(TRACE_DIR_ENV)
    t0 = time.monotonic()
    with engine("tiny-image", stage_kw=CPU) as eng:
        spawned_in = time.monotonic() - t0
        worker = _worker(eng)
        assert worker.ppid() == os.getpid() and "spawn_main" in " ".join(worker.cmdline())
        assert np.array_equal(_image(eng), forked)  # the same image either way
    # what the fork server is for: a start without the imports (seconds on this host)
    assert started < spawned_in, (started, spawned_in)


def test_forked_workers_exit_at_once_when_the_engine_process_dies_and_so_does_the_fork_server(
    tmp_path,
):
    from tests.reliability.procs import ServeProcess

    server = ServeProcess(["tiny-image", "--device", "cpu"], str(tmp_path))
    try:
        server.wait_healthy(120)
        workers = server.stage_workers()
        assert len(workers) == 1 and workers[0].name() == WORKER_NAME
        fork_server = workers[0].parent()
        assert fork_server is not None and mp_role(fork_server) == "forkserver"
        server.proc.kill()
        t0 = time.monotonic()
        wait_for(lambda: not server.processes(), 10, "the worker and the fork server gone")
        assert time.monotonic() - t0 < 10
    finally:
        server.cleanup()
