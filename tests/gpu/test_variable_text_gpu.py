"""Prompts of their own token counts in one running set on CUDA (#38): a row that joins rows of
other lengths (another text bucket, true CFG's two lengths) makes what it makes alone, PSNR
>= 35 dB in bf16, through the attention the stage runs there (padded keys zeroed, one unmasked
kernel); skipped where CUDA is absent (CI)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.models.tiny_qwen import tiny_qwen_image_path
from tests.models.tiny_z_image import tiny_z_image_path
from tests.stages.diffusion.test_running_set import _alone, _Harness, _req
from vllm_omni_like.config import StageConfig
from vllm_omni_like.stages.diffusion.stage import DiffusionStage

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
LONG = "a red circle and a blue square " * 12  # past the first text bucket
PATHS = {"z-image": tiny_z_image_path, "qwen-image": tiny_qwen_image_path}


@pytest.fixture(scope="module", params=sorted(PATHS))
def stage(request) -> DiffusionStage:
    config = StageConfig(
        name="diffusion", kind="diffusion", model=PATHS[request.param](), dtype="bf16"
    )
    stage = DiffusionStage(config)
    stage.load("cuda")
    return stage


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(float) - b.astype(float)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


def test_rows_of_other_lengths_joining_a_set_make_what_they_make_alone(stage):
    fast = {"zeroed padding keys", "padded_text_attention"}  # (Z-Image's, Qwen-Image's)
    assert fast & set(stage.runtime.speed.tuned), stage.runtime.speed.tuned
    a = _req("a", seed=3, steps=5, prompt="a red circle", guidance_scale=2.0)
    b = _req("b", seed=4, steps=4, prompt=LONG)  # the second text bucket
    c = _req("c", seed=5, steps=4, prompt="a blue square", guidance_scale=3.0, negative_prompt=LONG)
    alone = {r.request_id: _alone(stage, r) for r in (a, b, c)}
    h = _Harness(stage)
    h.add(1, a)
    h.steps(1)
    h.add(2, b, c)  # join a at its second step
    h.steps()
    for rid, image in alone.items():
        assert psnr(h.pixels(rid), image) >= 35, rid
