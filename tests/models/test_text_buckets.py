"""The prompts a compiled stage warms its text buckets up with (models/text_buckets.py): one a
bucket, within it, whatever the encoder's template adds; a bucket the encoder cannot reach is
left out; the families' own prompts land in each of their buckets by their own encoders."""

from __future__ import annotations

import pytest
import torch

from tests.models.tiny_qwen import tiny_qwen_image_path
from tests.models.tiny_z_image import tiny_z_image_path
from vllm_omni_like.config import StageConfig
from vllm_omni_like.models.text_buckets import TEXT_BUCKETS, bucket_prompts, text_bucket
from vllm_omni_like.stages.diffusion.stage import DiffusionStage


def _words(prompt: str) -> int:
    return len(prompt.split())


@pytest.mark.parametrize("overhead,per", [(1, 1), (37, 2), (60, 3), (5, 7)])
def test_each_bucket_gets_a_prompt_within_it(overhead, per):
    calls = []

    def count(prompt: str) -> int:
        calls.append(prompt)
        return overhead + per * _words(prompt)

    prompts = bucket_prompts(count)
    assert [text_bucket(count(p)) for p in prompts] == list(TEXT_BUCKETS)
    assert len(calls) <= 2 + 2 * len(TEXT_BUCKETS) + len(prompts)  # a guess or two a bucket


def test_a_bucket_past_the_encoders_truncation_is_left_out():
    def count(prompt: str) -> int:
        return min(20 + _words(prompt), 250)  # (it truncates at 250 tokens: never past 256)

    assert [text_bucket(count(p)) for p in bucket_prompts(count)] == [64, 128, 256]


@pytest.mark.slow
@pytest.mark.parametrize("path", [tiny_z_image_path, tiny_qwen_image_path], ids=["z", "qwen"])
def test_the_families_prompts_land_in_each_of_their_buckets(path):
    stage = DiffusionStage(StageConfig(name="diffusion", kind="diffusion", model=path()))
    stage.load("cpu")
    device = torch.device("cpu")
    with torch.inference_mode():
        adapter = stage.runtime.adapter
        prompts = adapter.warm_up_prompts(device)
        padded = [adapter.encode_text([p], device, 0)["embeds"].shape[1] for p in prompts]
    assert padded == list(TEXT_BUCKETS)
