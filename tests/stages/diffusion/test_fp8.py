"""The rowwise dynamic FP8 linear layer (stages/diffusion/fp8.py) on the CPU, whose
`torch._scaled_mm` takes rowwise FP8 as CUDA's does: its maths, torchao's at the same settings,
its dtypes under a model's `.to()`, and the SQNR it is judged by."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_omni_like.stages.diffusion.fp8 import (
    FP8,
    FP8_MAX,
    Fp8Linear,
    layer_sqnr,
    quantize_rows,
    sqnr_db,
)


def _linear(k: int = 64, n: int = 48, bias: bool = True, dtype=torch.float32) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(k, n, bias=bias, dtype=dtype)


def test_a_row_is_scaled_by_its_largest_magnitude_over_e4m3s_largest_value():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [448.0, 1e-3, -896.0]])
    values, scale = quantize_rows(x)
    assert values.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (3, 1)
    assert scale[0].item() == pytest.approx(2.0 / FP8_MAX)
    assert scale[2].item() == pytest.approx(896.0 / FP8_MAX)
    assert values[0].float().abs().max().item() == FP8_MAX  # each row's largest at 448
    assert values[1].float().abs().max().item() == 0.0  # a padded row stays zero
    back = values.float() * scale
    assert torch.allclose(back, x, rtol=2**-4, atol=1e-3)  # e4m3: 3 mantissa bits


def test_the_layer_computes_the_product_of_its_quantized_operands():
    """Exactly what its two quantized operands multiply to (then rounded to the input's
    dtype): the weight quantized once per output row, the input per row at the call."""
    linear = _linear()
    x = torch.randn(2, 5, 64)
    layer = Fp8Linear.from_linear(linear)
    xq, xs = quantize_rows(x.reshape(-1, 64))
    want = (xq.double() * xs) @ (layer.qweight.double() * layer.weight_scale).t() + linear.bias
    got = layer(x)
    assert got.shape == (2, 5, 48) and got.dtype == torch.float32
    assert torch.allclose(got.reshape(-1, 48).double(), want, atol=1e-5, rtol=1e-5)
    assert sqnr_db(linear(x), got) > 25


def test_a_layer_without_bias_and_a_bf16_layer():
    linear = _linear(bias=False, dtype=torch.bfloat16)
    layer = Fp8Linear.from_linear(linear)
    assert layer.bias is None
    x = torch.randn(7, 64, dtype=torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16 and sqnr_db(linear(x), out) > 25


def test_its_weight_is_no_weight_attribute_and_keeps_its_dtypes_under_to():
    """A model's `.to(dtype)` casts its floating tensors: the FP8 weight and its float32 scales
    keep theirs (values unchanged), the bias follows. Code reading `.weight` fails loudly."""
    layer = Fp8Linear.from_linear(_linear())
    qweight, scale = layer.qweight.clone(), layer.weight_scale.clone()
    assert not hasattr(layer, "weight")
    layer.to(torch.bfloat16)
    assert layer.qweight.dtype == FP8 and layer.weight_scale.dtype == torch.float32
    assert torch.equal(layer.qweight.float(), qweight.float())
    assert torch.equal(layer.weight_scale, scale)
    assert layer.bias.dtype == torch.bfloat16
    model = torch.nn.Sequential(layer).to("cpu", torch.float16)
    assert model[0].qweight.dtype == FP8 and model[0].bias.dtype == torch.float16
    assert [n for n, _ in layer.named_buffers()] == ["qweight", "weight_scale"]


def test_it_matches_torchaos_float8_tensor_at_the_same_settings():
    """torchao 0.18's rowwise dynamic FP8 (`Float8DynamicActivationFloat8WeightConfig(
    granularity=PerRow())`, what the benchmark's reference runs on CUDA) on the same bf16 layer:
    the same FP8 weight but where torchao's scale, computed in bf16, rounds a value to the next
    e4m3 step (ours is float32), and outputs as close to the layer's own. Its `quantize_`
    refuses the CPU, so its weight is built here as its config builds it
    (`Float8Tensor.from_hp`)."""
    torchao_quantization = pytest.importorskip("torchao.quantization")
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import (
        QuantizeTensorToFloat8Kwargs,
    )

    config = torchao_quantization.Float8DynamicActivationFloat8WeightConfig(
        granularity=torchao_quantization.PerRow()
    )
    activations, weights = config.granularity
    linear = _linear(k=128, n=64, dtype=torch.bfloat16)
    theirs = torch.nn.Linear(128, 64, dtype=torch.bfloat16)
    weight = torchao_quantization.Float8Tensor.from_hp(
        linear.weight.detach(),
        float8_dtype=config.weight_dtype,
        granularity=weights,
        mm_config=config.mm_config,
        kernel_preference=config.kernel_preference,
        act_quant_kwargs=QuantizeTensorToFloat8Kwargs(config.activation_dtype, activations),
    )
    theirs.weight = torch.nn.Parameter(weight, requires_grad=False)
    theirs.bias = linear.bias
    ours = Fp8Linear.from_linear(linear)
    codes = ours.qweight.view(torch.uint8).int() - weight.qdata.view(torch.uint8).int()
    assert codes.abs().max() <= 1 and (codes != 0).float().mean() < 0.02  # one step, rarely
    assert torch.allclose(ours.weight_scale, weight.scale, rtol=2**-8)  # bf16's rounding
    x = torch.randn(3, 9, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        want, mine, its = linear(x), ours(x), theirs(x)
    assert sqnr_db(its, mine) > 35
    assert abs(sqnr_db(want, mine) - sqnr_db(want, its)) < 1


def test_sqnr_is_the_signal_over_the_error_in_db():
    ref = torch.tensor([3.0, 4.0])
    assert sqnr_db(ref, ref) == math.inf
    assert sqnr_db(ref, ref * 1.1) == pytest.approx(20.0)  # error 10% of the signal: 20 dB
    assert layer_sqnr(_linear(), torch.randn(16, 64)) > 25
