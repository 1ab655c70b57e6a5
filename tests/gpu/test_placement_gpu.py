"""Stages on their own GPUs (--devices, YAML devices, gpu_memory_fraction); skipped without two
CUDA devices (CI). The CPU tests of the same logic: tests/engine/test_placement.py."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
import torch

from tests.engine.helpers import assert_clean, final, req
from vllm_omni_like.config import EngineConfig
from vllm_omni_like.engine import AsyncOmni
from vllm_omni_like.pipelines.catalog import builtin

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


def test_an_llm_and_a_diffusion_stage_each_on_its_own_gpu_with_a_memory_cap():
    omni = builtin("tiny-omni")
    llm, diffusion = omni.stages
    stages = (
        dataclasses.replace(llm, devices=(0,), gpu_memory_fraction=0.2),
        dataclasses.replace(diffusion, devices=(1,), gpu_memory_fraction=0.3),
    )
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    eng = AsyncOmni(EngineConfig(pipelines=(dataclasses.replace(omni, stages=stages),)))
    eng.start()
    try:
        out = asyncio.run(final(eng, req("r", "a red circle", pipeline="tiny-omni", steps=4)))
        assert out.ok, out.error
        found = {s["name"]: s["replicas"] for s in eng.health()}
        assert [r["device"] for r in found["llm"]] == ["cuda:0"]
        assert [r["device"] for r in found["diffusion"]] == ["cuda:1"]
        assert all(r["gpu_memory_bytes"] > 0 for rs in found.values() for r in rs)
        visible = [
            p.replicas[0].executor.visible_devices for p in eng.orchestrator.pools["tiny-omni"]
        ]
        assert visible == ["0", "1"]
        assert os.environ.get("CUDA_VISIBLE_DEVICES") == before  # set in the workers only
    finally:
        eng.shutdown()
    assert_clean(eng)
