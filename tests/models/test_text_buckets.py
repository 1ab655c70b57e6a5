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
from vllm_omni_like.models.z_image.sequence import CAPTION_BUCKETS
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


def _loaded(path: str):
    stage = DiffusionStage(StageConfig(name="diffusion", kind="diffusion", model=path))
    stage.load("cpu")
    return stage.runtime.adapter


@pytest.mark.slow
def test_qwen_images_prompts_land_in_each_of_its_buckets():
    adapter, device = _loaded(tiny_qwen_image_path()), torch.device("cpu")
    with torch.inference_mode():
        prompts = adapter.warm_up_prompts(device)
        padded = [adapter.encode_text([p], device, 0)["embeds"].shape[1] for p in prompts]
    assert padded == list(TEXT_BUCKETS)


@pytest.mark.slow
def test_z_images_prompts_give_each_bucket_a_full_and_a_padded_shape():
    """Z-Image pads a caption to 32s itself: per bucket a prompt that fills it (no mask), and
    one padded in it (a shorter prompt, or for 64, whose every caption fills it, rows beside
    the smallest bucket's); the smallest bucket can only be full."""
    adapter, device = _loaded(tiny_z_image_path()), torch.device("cpu")
    with torch.inference_mode():
        groups = adapter.warm_up_prompts(device)
        tokens = {p: int(adapter.encode_text([p], device, 0)["lengths"][0]) for p in _flat(groups)}
    full = [g for g in groups if isinstance(g, str) and -(-tokens[g] // 32) * 32 in CAPTION_BUCKETS]
    buckets = [text_bucket(tokens[g], CAPTION_BUCKETS) for g in full]
    assert buckets == list(CAPTION_BUCKETS[CAPTION_BUCKETS.index(buckets[0]) :])
    padded = [g for g in groups if g not in full]
    assert len(padded) == len(buckets) - 1  # (every bucket past the smallest)
    for g in padded:
        rows = [tokens[p] for p in ((g,) if isinstance(g, str) else g)]
        bucket = text_bucket(max(rows), CAPTION_BUCKETS)
        assert bucket > buckets[0] and min(-(-n // 32) * 32 for n in rows) < bucket


def _flat(groups) -> list[str]:
    return [p for g in groups for p in ((g,) if isinstance(g, str) else g)]
