"""Compiled text encoders on CUDA (#54): a join (a request's text encoders, its latents) with
the tiny SDXL's two CLIPs compiled (inductor, one text a call, as `--compile-text-encoders`
compiles them) takes less host time than with them eager - on a fast GPU eager encoders are
launch-bound - and gives their embeddings within bf16 rounding; skipped where CUDA is absent."""

from __future__ import annotations

import dataclasses
import statistics
import time

import pytest
import torch

from bench.join_profile import PROMPT, join_once
from tests.models.tiny_sdxl import tiny_sdxl_path
from vllm_omni_like.config import StageConfig
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.diffusion import acceleration as accel
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.wire import StageRequest

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _join_ms(stage: DiffusionStage, request: StageRequest, runs: int = 20) -> float:
    times = []
    for _ in range(runs + 2):  # (two first: warm-up)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        join_once(stage, request)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) * 1e3


@pytest.mark.timeout(600)
def test_a_join_with_compiled_text_encoders_is_faster_and_gives_the_same_embeddings():
    config = StageConfig(name="d", kind="diffusion", model=tiny_sdxl_path(), dtype="bf16")
    stage = DiffusionStage(config)
    stage.load("cuda")
    rt = stage.runtime
    request = StageRequest("r", PROMPT, GenerationParams(seed=0, num_inference_steps=4))
    with torch.inference_mode():
        want = rt.text([PROMPT, None])
    eager_ms = _join_ms(stage, request)
    assert accel.compile_text_encoders(rt.adapter, "default", "inductor") == [
        "text_encoder",
        "text_encoder_2",
    ]
    rt.denoise.embed = dataclasses.replace(rt.text, one_text_a_call=True)
    with torch.inference_mode():
        got = rt.denoise.embed([PROMPT, None])
    compiled_ms = _join_ms(stage, request)
    print(f"join: eager text encoders {eager_ms:.2f} ms, compiled {compiled_ms:.2f} ms")
    for key in ("embeds", "pooled"):
        torch.testing.assert_close(got[key], want[key], rtol=2e-2, atol=2e-2)
    assert compiled_ms < eager_ms
