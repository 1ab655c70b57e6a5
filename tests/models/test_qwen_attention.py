"""Qwen-Image's attention over padded texts (models/qwen_image/attention.py): one unmasked
call over zeroed padding, corrected by its log-sum-exp, is diffusers' masked call to float
rounding, for rows of any text length (none included), a
row's result independent of its neighbours, and diffusers' own processor kept where there is
no mask or the blocks carry another processor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.models.tiny_qwen import tiny_qwen_image_path
from vllm_omni_like.models.qwen_image.attention import (
    PaddedTextAttnProcessor,
    use_padded_text_attention,
    zeroed_padding_attention,
)

pytestmark = pytest.mark.slow


def test_the_corrected_unmasked_softmax_is_the_masked_one_for_any_text_length():
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 8 + 20, 2, 16) for _ in range(3))  # (B, S, H, D): 8 text tokens
    mask = torch.zeros(3, 8, dtype=torch.bool)
    mask[0, :5], mask[2, :] = True, True  # row 1: no text token at all
    joint = torch.cat([mask, torch.ones(3, 20, dtype=torch.bool)], dim=1)[:, None, None, :]
    want = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), joint)
    got = zeroed_padding_attention(q, k, v, mask)
    assert got.shape == q.shape
    torch.testing.assert_close(got.transpose(1, 2), want, atol=2e-6, rtol=1e-5)
    assert torch.isfinite(got).all()


@pytest.fixture(scope="module")
def transformer():
    from diffusers import QwenImageTransformer2DModel

    model = QwenImageTransformer2DModel.from_pretrained(
        tiny_qwen_image_path(), subfolder="transformer"
    )
    return model.eval()


def _forward(model, rows: list[int], masked: bool = True, only: int | None = None):
    """Rows of 4x4 packed latents, text of `rows[i]` real tokens padded to 16 (`only`: that
    row alone)."""
    g = torch.Generator().manual_seed(1)
    cfg = model.config
    latents = torch.randn(len(rows), 16, cfg.in_channels, generator=g)
    text = torch.randn(len(rows), 16, cfg.joint_attention_dim, generator=g)
    mask = (torch.arange(16)[None, :] < torch.tensor(rows)[:, None]).long()
    if only is not None:
        rows, latents, text, mask = (
            [rows[only]],
            *(x[only : only + 1] for x in (latents, text, mask)),
        )
    with torch.no_grad():
        return model(
            hidden_states=latents,
            timestep=torch.full((len(rows),), 0.5),
            encoder_hidden_states=text,
            encoder_hidden_states_mask=mask if masked else None,
            img_shapes=[[(1, 4, 4)]] * len(rows),
            return_dict=False,
        )[0]


def test_the_transformer_makes_what_diffusers_masked_attention_makes(transformer):
    rows = [5, 16, 1]
    want, want_unmasked = _forward(transformer, rows), _forward(transformer, rows, masked=False)
    assert use_padded_text_attention(transformer)
    try:
        assert {type(p) for p in transformer.attn_processors.values()} == {PaddedTextAttnProcessor}
        assert not use_padded_text_attention(transformer)  # (another processor: kept)
        torch.testing.assert_close(_forward(transformer, rows), want, atol=1e-5, rtol=1e-4)
        assert torch.equal(_forward(transformer, rows, masked=False), want_unmasked)
        # a row alone, at the same bucket, is the row among others
        together = _forward(transformer, rows)
        for i in range(len(rows)):
            alone = _forward(transformer, rows, only=i)[0]
            torch.testing.assert_close(alone, together[i], atol=1e-6, rtol=0)
    finally:
        from diffusers.models.transformers.transformer_qwenimage import (
            QwenDoubleStreamAttnProcessor2_0,
        )

        transformer.set_attn_processor(QwenDoubleStreamAttnProcessor2_0())


def test_float32_off_the_cpu_keeps_diffusers_masked_call():
    from vllm_omni_like.models.zeroed_keys import has_lse_kernel

    assert has_lse_kernel(torch.zeros(1))  # the CPU's flash kernel: any dtype
    assert not has_lse_kernel(torch.zeros(1, device="meta"))  # (CUDA's: half precision only)
    assert has_lse_kernel(torch.zeros(1, device="meta", dtype=torch.bfloat16))
