"""GPU paths of the speed options; skipped where CUDA is absent (CI). Timings live in bench/."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from vllm_omni_like.messages import StageRequest
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.pipelines import catalog
from vllm_omni_like.stages import acceleration as accel
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.diffusion import DiffusionStage
from vllm_omni_like.stages.faults import FaultInjector

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _run(stage: DiffusionStage, seeds: list[int]) -> list[np.ndarray]:
    reqs = [
        StageRequest(f"r{s}", "a red circle", GenerationParams(seed=s, num_inference_steps=3))
        for s in seeds
    ]
    outs = stage.execute(reqs, StageControl(FaultInjector((), "diffusion")))
    return [o.images[0].pixels for o in outs]


@pytest.fixture(scope="module")
def sd15():
    (pipeline,) = catalog.resolve("sd15", load_format="dummy", dtype="fp16")
    stage = DiffusionStage(pipeline.stages[0])
    stage.load("cuda")
    return stage


def test_sd15_on_cuda_uses_the_fast_kernels_and_batches_match_singles(sd15):
    # eager: NCHW and cuDNN's heuristics (measured faster, see acceleration.py), fused QKV
    assert not sd15.channels_last and sd15.tuned == ["fused_qkv"]
    batched = _run(sd15, [1, 2, 3])
    for seed, image in zip([1, 2, 3], batched, strict=True):
        (alone,) = _run(sd15, [seed])
        mse = np.mean((alone.astype(float) - image.astype(float)) ** 2)
        assert mse == 0 or 10 * np.log10(255**2 / mse) >= 35  # fp16: PSNR >= 35 dB


def test_xformers_is_used_only_when_its_kernels_run(caplog, sd15):
    unet = sd15.pipe.unet
    before = dict(unet.attn_processors)
    with caplog.at_level(logging.WARNING):
        got = accel.set_attention(sd15.pipe, "xformers", torch.device("cuda"), "diffusion")
    problem = accel.xformers_problem(torch.device("cuda"))
    assert got == ("xformers" if problem is None else "sdpa")
    if problem is not None:  # the fallback leaves the (fused SDPA) processors as they were
        assert "falling back to PyTorch SDPA" in caplog.text
        assert all(unet.attn_processors[k] is p for k, p in before.items())
    unet.set_attn_processor(before)  # leave the module fixture as it was
