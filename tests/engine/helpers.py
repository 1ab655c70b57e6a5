"""Engines on null pipelines with real worker processes, for orchestrator tests."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal

from vllm_omni_like.config import EngineConfig, parse_faults
from vllm_omni_like.engine import AsyncOmni
from vllm_omni_like.engine.request_state import BatchReport
from vllm_omni_like.inputs import OmniRequest
from vllm_omni_like.outputs import OmniRequestOutput, RequestProgress
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.pipelines.catalog import resolve


@contextlib.contextmanager
def engine(
    spec: str = "null-omni",
    faults: str = "",
    stage_kw: dict | None = None,
    stage_kind: str | None = None,  # every stage's class ('module:Class'), for test stages
    executor_factory=None,  # the replicas' executor class (a test's, wrapping the real one)
    **kw,
):
    pipelines = resolve(spec, **(stage_kw or {}))
    if stage_kind is not None:
        pipelines = [
            dataclasses.replace(
                p, stages=tuple(dataclasses.replace(s, kind=stage_kind) for s in p.stages)
            )
            for p in pipelines
        ]
    config = EngineConfig(pipelines=tuple(pipelines), faults=parse_faults(faults), **kw)
    eng = AsyncOmni(config, executor_factory)
    eng.batches = record_batches(eng)
    eng.start()
    try:
        yield eng
    finally:
        eng.shutdown()
        assert_clean(eng)


def assert_clean(eng: AsyncOmni) -> None:
    """No per-request state is left anywhere in the engine."""
    orch = eng.orchestrator
    assert orch.requests == {}
    assert len(orch.ledger) == 0  # no id held, no store unreported
    assert all(not p.waiting for pools in orch.pools.values() for p in pools)
    snap = eng.stats.snapshot()
    assert sum(snap["final"].values()) == snap["requests_total"]


def req(
    rid: str,
    prompt: str = "a cat",
    pipeline: str = "null-omni",
    steps: int = 2,
    delay: float = 0.0,
    seed: int = 1,
    timeout: float | None = None,
    **kw,
) -> OmniRequest:
    params = GenerationParams(seed=seed, num_inference_steps=steps, step_delay=delay, **kw)
    return OmniRequest(rid, prompt, pipeline, params, timeout=timeout)


async def collect(
    eng: AsyncOmni, request: OmniRequest
) -> tuple[list[RequestProgress], OmniRequestOutput]:
    events = []
    async for ev in eng.generate(request):
        if isinstance(ev, OmniRequestOutput):
            return events, ev
        events.append(ev)
    raise AssertionError("no final output")


async def final(eng: AsyncOmni, request: OmniRequest) -> OmniRequestOutput:
    return (await collect(eng, request))[1]


async def gather(eng: AsyncOmni, requests: list[OmniRequest]) -> list[OmniRequestOutput]:
    return await asyncio.gather(*(final(eng, r) for r in requests))


def kill_worker(eng: AsyncOmni, pipeline: str, stage: int, replica: int = 0) -> int:
    executor = eng.orchestrator.pools[pipeline][stage].replicas[replica].executor
    pid = executor.pids[0]
    os.kill(pid, signal.SIGKILL)
    return pid


def record_batches(eng: AsyncOmni) -> list[BatchReport]:
    """Every batch the engine's stages finish from now on (an observer of its stats)."""
    reports: list[BatchReport] = []
    eng.stats.batch_observers.append(reports.append)
    return reports


def steps_of(eng: AsyncOmni, rid: str, stage: str) -> list[int]:
    """Steps request `rid` ran in `stage`, per batch it was in (engines made by `engine()`)."""
    return [b.steps_run[rid] for b in eng.batches if b.stage == stage and rid in b.steps_run]
