"""The FP8 attention kernel on a GPU (`--attention fp8`): against its emulation and exact
attention at FLUX.1-dev's shape and Qwen-Image's with a padded text, the start-up check, a
routed attention compiled by Inductor without a graph break. Skipped without CUDA 8.9+ (CI); a
stage serving with it: bench/fp8.py's `fp8-attention` part; timings: bench/fp8_attention.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.stages.diffusion.test_fp8_attention import _flux_attention
from vllm_omni_like.stages.diffusion import fp8_attention as fa
from vllm_omni_like.stages.diffusion.fp8 import sqnr_db

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
    reason="needs a CUDA device of compute capability 8.9 or newer",
)


def _qkv(batch, seq, heads, dim, keys=None):
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(batch, seq, heads, dim), *[(batch, keys or seq, heads, dim)] * 2]
    return [torch.randn(s, device="cuda", generator=g).bfloat16() for s in shapes]


@pytest.mark.parametrize(
    ("batch", "seq", "heads", "dim", "keys"),
    [(1, 4608, 24, 128, None), (2, 1000, 4, 64, None), (1, 300, 2, 128, 77)],
)
def test_the_kernel_computes_its_emulations_maths(batch, seq, heads, dim, keys):
    q, k, v = _qkv(batch, seq, heads, dim, keys)
    got = fa.fp8_attention(q, k, v, dim**-0.5)
    assert got.shape == q.shape and got.dtype == torch.bfloat16 and got.is_contiguous()
    # the same maths (only the float32 sums' order and exp2's last bits differ)
    assert sqnr_db(fa.emulate(q, k, v, dim**-0.5), got) > 40
    exact = F.scaled_dot_product_attention(*(x.transpose(1, 2).float() for x in (q, k, v)))
    assert sqnr_db(exact.transpose(1, 2), got) > 24  # (the emulation's on the CPU: 25.7-26.1)


def test_a_key_padding_mask_is_taken():
    """Qwen-Image's shape at 1024x1024 with a text padded to its bucket: 4096 image tokens
    after 256 text tokens of which the first 100 are real."""
    q, k, v = _qkv(2, 4352, 24, 128)
    keep = torch.ones(2, 4352, dtype=torch.bool, device="cuda")
    keep[:, 100:256] = False
    got = fa.fp8_attention(q, k, v, 128**-0.5, keep)
    assert sqnr_db(fa.emulate(q, k, v, 128**-0.5, keep), got) > 40
    qd, kd, vd = (x.transpose(1, 2).float() for x in (q, k, v))
    exact = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=keep[:, None, None, :])
    assert sqnr_db(exact.transpose(1, 2), got) > 24


def test_the_start_up_check_passes_here():
    assert fa.fp8_attention_problem(torch.device("cuda")) is None


def test_a_routed_attention_compiles_with_inductor_without_a_break():
    attention = _flux_attention().cuda()
    fa.route_fp8_attention(attention)
    x = torch.randn(2, 256, 128, device="cuda").bfloat16()
    text = torch.randn(2, 32, 128, device="cuda").bfloat16()
    with torch.no_grad():
        eager = attention(x, text)
        compiled = torch.compile(attention, fullgraph=True, dynamic=False)(x, text)
    for got, want in zip(compiled, eager, strict=True):
        assert sqnr_db(want, got) > 40  # (Inductor fuses the projections' epilogues)
