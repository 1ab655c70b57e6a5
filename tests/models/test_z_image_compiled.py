"""Z-Image's sequences padded to text buckets (models/z_image/sequence.py): a compiled stage
runs prompts of new lengths and of every text bucket on its warm-up's graphs, its images those
of the plain stage; the padded forward is the transformer's own at the rows'
lengths; the attention over zeroed padding keys is diffusers' masked one."""

from __future__ import annotations

import diffusers
import numpy as np
import pytest
import torch

from tests.models.tiny_z_image import tiny_z_image_path
from tests.stages.diffusion.test_compiled import _compiled_stage, _control
from vllm_omni_like.config import StageConfig
from vllm_omni_like.models.z_image import sequence
from vllm_omni_like.models.z_image.sequence import (
    UnmaskedShapes,
    ZeroedKeysProcessor,
    pad_sequences_to_buckets,
    use_zeroed_keys,
)
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.wire import StageRequest

pytestmark = pytest.mark.slow
PROMPTS = ("a cat", "a cat sitting on a mat in the sun", "a red circle on a blue square " * 4)
LONG = "a red circle on a blue square " * 20  # past the first text bucket


def _run(stage: DiffusionStage, prompt: str, guidance: float = 0.0) -> np.ndarray:
    params = GenerationParams(seed=3, num_inference_steps=2, guidance_scale=guidance)
    (out,) = stage.execute([StageRequest("r", prompt, params)], _control())
    assert out.error is None, out.error
    return out.images[0].pixels.astype(int)


@pytest.mark.timeout(300)  # (its text encoders compile too: 80-130 s on two loaded cores)
def test_prompts_of_new_lengths_run_on_the_warm_up_graphs(capfd):
    from torch._dynamo.utils import counters

    plain = DiffusionStage(
        StageConfig(name="diffusion", kind="diffusion", model=tiny_z_image_path())
    )
    plain.load("cpu")
    # (its Qwen3 compiled too, layer by layer: read at each caption bucket, one text a call)
    stage = _compiled_stage(2, (1, 2), model=tiny_z_image_path(), compile_text_encoders="on")
    assert type(stage.runtime.pipe.text_encoder.layers[0]).__name__ == "OptimizedModule"
    transformer = stage.runtime.pipe.transformer
    assert type(transformer).__name__ == "ZImageTransformer2DModel"  # its blocks:
    assert type(transformer.layers[0]).__name__ == "OptimizedModule"
    graphs = counters["stats"]["unique_graphs"]
    capfd.readouterr()
    for prompt in PROMPTS:
        assert np.abs(_run(stage, prompt) - _run(plain, prompt)).max() <= 1
    _run(stage, PROMPTS[0], guidance=2.0)  # two rows of two lengths: the warmed-up 2 rows
    assert counters["stats"]["unique_graphs"] == graphs  # nothing recompiled
    assert "Recompiling" not in capfd.readouterr().err
    # another text bucket, and two rows of two buckets: warmed up too (a prompt a bucket)
    for prompt, guidance in ((LONG, 0.0), (LONG + " at dawn", 0.0), (LONG, 2.0)):
        assert np.abs(_run(stage, prompt, guidance) - _run(plain, prompt, guidance)).max() <= 1
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled at run time
    assert "Recompiling" not in capfd.readouterr().err


@pytest.fixture
def transformer():  # (a fresh one each: the tests change it)
    pipe = diffusers.DiffusionPipeline.from_pretrained(
        tiny_z_image_path(), local_files_only=True, dtype=torch.float32
    )
    return pipe.transformer


def _inputs(transformer, lengths: tuple[int, ...]) -> tuple[list, torch.Tensor, list]:
    """A 16x16 latent frame and a caption of each length (random), one timestep each."""
    torch.manual_seed(0)
    config = transformer.config
    frames = [torch.randn(config.in_channels, 1, 8, 8) for _ in lengths]
    captions = [torch.randn(n, config.cap_feat_dim) for n in lengths]
    return frames, torch.full((len(lengths),), 0.3), captions


def test_the_padded_forward_is_the_transformers_own_at_the_rows_lengths(transformer):
    lengths = (5, 37, 70)  # three lengths in three 32-blocks, two text buckets
    frames, t, captions = _inputs(transformer, lengths)
    with torch.inference_mode():
        want = [
            transformer([f], t[:1], [c], return_dict=False)[0][0]
            for f, c in zip(frames, captions, strict=True)
        ]
        pad_sequences_to_buckets(transformer)
        got = transformer(frames, t, captions, return_dict=False)[0]
        for i, (f, c) in enumerate(zip(frames, captions, strict=True)):
            alone = transformer([f], t[:1], [c], return_dict=False)[0][0]
            torch.testing.assert_close(got[i], want[i], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(alone, want[i], atol=1e-5, rtol=1e-4)


def test_zeroed_keys_attention_is_diffusers_masked_attention(transformer):
    pad_sequences_to_buckets(transformer)
    frames, t, captions = _inputs(transformer, (5, 37))
    with torch.inference_mode():
        want = transformer(frames, t, captions, return_dict=False)[0]
        assert use_zeroed_keys(transformer)
        assert all(
            type(m.processor) is ZeroedKeysProcessor
            for m in transformer.modules()
            if hasattr(m, "set_processor")
        )
        got = transformer(frames, t, captions, return_dict=False)[0]
        assert not use_zeroed_keys(transformer)  # (not diffusers' processor any more: kept)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_rows_that_fill_their_bucket_run_without_a_mask_where_the_warm_up_ran_so():
    shapes = UnmaskedShapes()
    assert shapes.allows("caption", [64, 64], 64)  # (warming up: any, and kept)
    assert not shapes.allows("caption", [32, 64], 64)  # padded: a mask
    shapes.frozen = True
    assert shapes.allows("caption", [64, 64], 64)  # the warm-up ran it so
    assert not shapes.allows("caption", [64], 64)  # one row of 64 did not: masked, no new graph
    assert not shapes.allows("joint", [64, 64], 64)  # nor a joint sequence of that length
    assert ("caption", 1, 64) not in shapes.seen


def test_a_caption_that_fills_its_bucket_takes_diffusers_unmasked_attention(
    transformer, monkeypatch
):
    """Lengths in tokens as the transformer pads them (to 32s): a caption of 5 fills bucket 32
    and one of 37 bucket 64 (no mask: the zeroed-keys path never runs); 5 beside 37 pads the
    first to 64 (masked); each row's result is its own alone either way."""
    masked: list[int] = []
    real = sequence.zeroed_keys_attention

    def spy(q, k, v, keep):
        masked.append(int((~keep).sum()))
        return real(q, k, v, keep)

    monkeypatch.setattr(sequence, "zeroed_keys_attention", spy)
    pad_sequences_to_buckets(transformer)
    assert use_zeroed_keys(transformer)
    frames, t, captions = _inputs(transformer, (5, 37))
    with torch.inference_mode():
        alone = [
            transformer([f], t[:1], [c], return_dict=False)[0][0]
            for f, c in zip(frames, captions, strict=True)
        ]
        assert masked == []
        both = transformer(frames, t, captions, return_dict=False)[0]
    assert masked and all(n == 32 for n in masked)  # the first row's 32 padded keys
    for a, b in zip(both, alone, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_a_padded_single_row_has_the_strides_of_a_new_tensor():
    """One row sliced from a longer sequence counts as contiguous whatever its first stride; a
    compiled block guards on it, so a row without guidance (one model row) gets fresh ones."""
    from vllm_omni_like.models.z_image.sequence import pad_to

    row = torch.randn(3, 736, 4)[:1, :200]
    assert row.is_contiguous() and row.stride() != torch.empty(1, 256, 4).stride()
    padded = pad_to(row, 256)
    assert padded.stride() == torch.empty(1, 256, 4).stride()
    assert torch.equal(padded[:, :200], row) and not padded[:, 200:].any()
