"""FP8 attention (`--attention fp8`, stages/diffusion/fp8_attention.py) on the CPU: its
emulation against exact attention on random and outlier inputs, the Triton kernel against the
emulation under Triton's interpreter, the custom op inside torch.compile without a graph
break, the routing of diffusers' processors (unmasked calls to FP8, masked ones to SDPA), a
stage's image with it against the same stage without, and the start-up refusals with their
exact messages."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.models.test_family_contract import _run, case_of
from vllm_omni_like.config import StageConfig
from vllm_omni_like.errors import ConfigError
from vllm_omni_like.stages.diffusion import fp8_attention as fa
from vllm_omni_like.stages.diffusion import quantize
from vllm_omni_like.stages.diffusion.fp8 import sqnr_db
from vllm_omni_like.stages.diffusion.stage import DiffusionStage


def _qkv(batch=1, seq=300, heads=2, dim=64, keys=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, seq, heads, dim), *[(batch, keys or seq, heads, dim)] * 2]
    return [torch.randn(s, generator=g).bfloat16() for s in shapes]


def _exact(q, k, v, scale=None):
    """Attention in float64 over the same bf16 inputs, (B, S, H, D)."""
    q, k, v = (x.transpose(1, 2).double() for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2)


def _cosine(a, b):
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


# ---- the maths ---------------------------------------------------------------------------------
@pytest.mark.parametrize("dim", [64, 128])
def test_the_emulation_is_close_to_exact_attention_on_random_inputs(dim):
    q, k, v = _qkv(dim=dim, seq=300)  # (not a multiple of either block)
    got = fa.emulate(q, k, v, dim**-0.5)
    assert got.dtype == torch.bfloat16 and got.shape == q.shape and got.is_contiguous()
    want = _exact(q, k, v)
    # measured: 25.8 dB (64), 26.1 dB (128); cosine 0.9987 (the e4m3 P and V of a flat softmax)
    assert sqnr_db(want, got) > 24 and _cosine(want, got) > 0.998


def _outliers(q, k, v, offset=60.0):
    """Real attention's outliers: keys with a large offset on a few channels, much larger query
    and key tokens than the rest, a value channel 50x the others, a peaked softmax."""
    q, k, v = (x.float() for x in (q, k, v))
    k[..., :4] += offset  # a channel-wise offset 60x the keys' own spread
    q[:, 7] *= 30.0  # (one scale a block of Q or K)
    k[:, 11] *= 8.0
    v[..., 5] *= 50.0  # (one scale a channel of V)
    return [x.bfloat16() for x in (q * 3.0, k, v)]


def test_the_emulation_keeps_its_accuracy_on_outlier_inputs():
    q, k, v = _outliers(*_qkv(seq=256, keys=320, seed=1))
    got, want = fa.emulate(q, k, v, 0.125), _exact(q, k, v, 0.125)
    # measured: 22.5 dB, cosine 0.9971 (the peaked softmax costs most: 21.8 dB alone, the
    # e4m3 scores' error grows with the logits; the value channel 22.7, the tokens 24.6-26.7)
    assert sqnr_db(want, got) > 21 and _cosine(want, got) > 0.995


def test_smoothing_the_keys_takes_their_offset_out_of_the_error(monkeypatch):
    q, k, v = _qkv(seq=256, keys=320, seed=1)
    shifted = (k.float() + torch.linspace(0, 60, 64)).bfloat16()  # an offset on every channel
    plain = sqnr_db(_exact(q, k, v, 0.125), fa.emulate(q, k, v, 0.125))
    want = _exact(q, shifted, v, 0.125)  # (the shifted keys' own: bf16 rounded them)
    assert abs(sqnr_db(want, fa.emulate(q, shifted, v, 0.125)) - plain) < 1  # (25.6, 25.7 dB)
    monkeypatch.setattr(fa, "key_mean", lambda k: torch.zeros(k.shape[0], *k.shape[2:]))
    assert sqnr_db(want, fa.emulate(q, shifted, v, 0.125)) < 15  # not smoothed: -0.05 dB


def test_the_emulation_leaves_out_the_keys_a_key_padding_mask_leaves_out():
    q, k, v = _qkv(batch=2, seq=200, seed=4)
    keep = torch.ones(2, 200, dtype=torch.bool)
    keep[0, 20:100], keep[1, :64] = False, False  # (row 1: its whole first key block)
    k[0, 20:100] *= 40  # padded keys and values far out of the real ones' range
    v[1, :64] += 100
    got = fa.emulate(q, k, v, 0.125, keep)
    mask = keep[:, None, None, :]
    qd, kd, vd = (x.transpose(1, 2).double() for x in (q, k, v))
    want = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask).transpose(1, 2)
    assert sqnr_db(want, got) > 24 and torch.isfinite(got).all()  # (measured: 25.9 dB)


def test_a_query_whose_keys_are_all_left_out_gives_zeros_as_sdpa_does():
    """A batch row whose key-padding mask keeps no key: 0 out (no division by a zero row
    sum), as SDPA gives; the other row is as it was alone."""
    q, k, v = _qkv(batch=2, seq=130)
    keep = torch.ones(2, 130, dtype=torch.bool)
    keep[1] = False
    got = fa.emulate(q, k, v, 0.125, keep)
    mask = keep[:, None, None, :]
    want = F.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (q, k, v)), mask, scale=0.125
    )
    assert torch.equal(want[1], torch.zeros_like(want[1]))  # (SDPA's answer, this torch's)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert torch.equal(got[:1], fa.emulate(q[:1], k[:1], v[:1], 0.125, keep[:1]))


def test_the_emulation_takes_fewer_keys_than_queries_and_a_scale():
    q, k, v = _qkv(seq=150, keys=70, dim=128)
    got = fa.emulate(q, k, v, 0.05)
    assert got.shape == q.shape
    assert sqnr_db(_exact(q, k, v, 0.05), got) > 24


# ---- the kernel, under Triton's interpreter ------------------------------------------------------
@pytest.fixture(scope="module")
def interpreted():
    """The kernel's results against the emulation's, from a process run with TRITON_INTERPRET=1
    (tests/stages/diffusion/interpreted_kernel.py: Triton decides at its import)."""
    if importlib.util.find_spec("triton") is None:
        if os.environ.get("CI") == "true":  # (the test extra brings it: CI runs these)
            pytest.fail("triton is not installed under CI: pip install -e '.[test]'")
        pytest.skip("triton is not installed (the test extra installs it)")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    module = "tests.stages.diffusion.interpreted_kernel"
    done = subprocess.run(
        [sys.executable, "-m", module], env=env, capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["tail", "cross", "whole", "masked", "blank", "strided", "far"])
def test_the_kernel_computes_the_emulations_maths(interpreted, case):
    """The same maths; only the order of the float32 sums differs, then bf16's rounding
    (measured: 47.8 dB, at most one bf16 step apart). `tail`: a last block of keys and queries
    part-filled; `cross`: fewer keys than queries, head size 128, batch 2; `whole`: whole
    blocks; `masked`: a key-padding mask; `blank`: a batch row of no key kept (0 out, not
    NaN); `strided`: FLUX.1's fused QKV, views of one
    projection; `far`: a batch row whose offsets pass 2^31 elements (int32 offsets wrapped
    round there: the interpreter read outside the tensor and crashed)."""
    found = interpreted[case]
    assert found["like_q"]
    assert case != "far" or found["offset"] > 2**31
    assert case != "blank" or found["zeros"]
    assert found["sqnr_db"] > 44 and found["max_bf16_steps"] <= 2, found


# ---- the op, torch.compile, the routing ------------------------------------------------------
def test_the_op_compiles_into_one_graph_without_a_break():
    def block(q, k, v):
        return torch.ops.vllm_omni_like.fp8_attention(q * 2, k, v, 0.125) + 1

    q, k, v = _qkv(seq=70)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")  # (the fake op traced)
    assert torch.equal(compiled(q, k, v), block(q, k, v))


def _flux_attention():
    from diffusers.models.transformers.transformer_flux import FluxAttention

    torch.manual_seed(0)
    attention = FluxAttention(query_dim=128, heads=2, dim_head=64, added_kv_proj_dim=128)
    return attention.bfloat16().requires_grad_(False)  # (inference: the op has no backward)


def test_a_denoiser_without_a_routed_attention_is_refused():
    from types import SimpleNamespace

    from vllm_omni_like.stages.diffusion.acceleration import fp8_attention

    attention = _flux_attention()  # its processor calling SDPA itself, as SD3's do
    attention.processor = type("OwnProcessor", (), {"__call__": print})()
    adapter = SimpleNamespace(experts=lambda: [SimpleNamespace(model=attention)])
    with pytest.raises(ConfigError) as info:
        fp8_attention(adapter, "diffusion")
    assert str(info.value) == (
        "stage 'diffusion': --attention fp8 found no attention of this model that calls "
        "diffusers' dispatch_attention_fn: serve it with --attention sdpa"
    )


def test_unmasked_and_key_padded_calls_go_to_the_fp8_op_and_others_stay_sdpa(monkeypatch):
    calls = []
    emulate = fa.emulate
    monkeypatch.setattr(fa, "emulate", lambda *a: calls.append(a[0].shape) or emulate(*a))
    attention = _flux_attention()
    x, text = torch.randn(1, 96, 128).bfloat16(), torch.randn(1, 20, 128).bfloat16()
    before = attention(x, text)
    assert fa.route_fp8_attention(attention) == 1
    after = attention(x, text)
    assert calls == [(1, 116, 2, 64)]  # [text, image], once
    for old, new in zip(before, after, strict=True):
        assert sqnr_db(old, new) > 20  # (measured: 26 dB)
    assert type(attention.processor).__name__ == "FluxAttnProcessor"  # (diffusers reads it)
    assert fa.route_fp8_attention(attention) == 1  # routed once, counted again
    # any mask but a key-padding one (or a head size the kernel does not take): diffusers'
    # own dispatch, exactly
    dispatch = fa.fp8_dispatch(lambda *a, **kw: "original")
    q, k, v = _qkv(seq=40)
    assert dispatch(q, k, v, attn_mask=torch.ones(1, 1, 40, 40, dtype=torch.bool)) == "original"
    assert dispatch(q, k, v, attn_mask=torch.zeros(1, 1, 1, 40)) == "original"  # (additive)
    assert dispatch(*(x[..., :32] for x in (q, k, v))) == "original"
    assert dispatch(*(x.float() for x in (q, k, v))) == "original"
    assert len(calls) == 1 and isinstance(dispatch(q, k, v), torch.Tensor)
    keep = torch.arange(40) < 30  # a padded text's key-padding mask (Qwen-Image's, Z-Image's)
    got = dispatch(q, k, v, attn_mask=keep[None, None, None, :])
    assert len(calls) == 3 and torch.equal(got, fa.emulate(q, k, v, 0.125, keep[None]))


def test_a_routed_block_is_another_trace_to_the_precompiled_forwards():
    """A forward precompiled without FP8 attention is never loaded for one with it."""
    from vllm_omni_like.stages.diffusion.precompiled import structure

    attention = _flux_attention()
    before = structure(attention)
    fa.route_fp8_attention(attention)
    assert structure(attention) != before
    assert structure(attention) == structure(attention)


def test_a_routed_block_compiles_without_a_break():
    attention = _flux_attention()
    fa.route_fp8_attention(attention)
    x, text = torch.randn(1, 64, 128).bfloat16(), torch.randn(1, 16, 128).bfloat16()
    compiled = torch.compile(attention, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(x, text), attention(x, text), strict=True):
        assert torch.equal(got, want)


# ---- a stage ------------------------------------------------------------------------------
# FLUX.1 by default; the families that pass key-padding masks (padded texts) with `-m drill`
MASKED = ("qwen-image", "z-image")
STAGE_FAMILIES = ["flux", *(pytest.param(n, marks=pytest.mark.drill) for n in MASKED)]


@pytest.mark.slow
@pytest.mark.parametrize("name", STAGE_FAMILIES)
def test_a_stage_with_fp8_attention_draws_its_bf16_image(monkeypatch, name):
    """A family's tiny model (head sizes 8-32: let through here, the kernel takes 64 and 128)
    with its attention in FP8 - on the CPU through the emulation, on a device said to pass the
    check - against the same stage in bf16."""
    monkeypatch.setattr(fa, "fp8_attention_problem", lambda device: None)  # (an H100, say)
    monkeypatch.setattr(fa, "HEAD_DIMS", (8, 16, 32, 64, 128))
    calls = []
    emulate = fa.emulate
    monkeypatch.setattr(fa, "emulate", lambda *a: calls.append(a[4] is not None) or emulate(*a))
    case = case_of(name)
    plain = _run(case.stage(dtype="bf16"), case.request())
    stage = case.stage(dtype="bf16", attention="fp8")
    assert stage.precision() == "bf16, fp8 attention"
    fp8 = _run(stage, case.request())
    assert calls  # (every block's attention, every step)
    # Qwen-Image pads its text to a bucket: key-padding masks (Z-Image's lone row: none)
    assert any(calls) == (name == "qwen-image")
    assert np.array_equal(fp8, _run(stage, case.request()))  # deterministic
    mse = np.mean((plain.astype(float) - fp8.astype(float)) ** 2)
    # measured: FLUX.1 51.7 dB, Qwen-Image 52.4, Z-Image 51.0 (Wan2.2-TI2V 48.1)
    assert 10 * np.log10(255**2 / max(mse, 1e-12)) > 40


# ---- the refusals -------------------------------------------------------------------------------
def test_the_cpu_and_the_families_it_does_not_run_are_refused_at_start_up_naming_the_flag():
    from vllm_omni_like.models.limits import describe_stage
    from vllm_omni_like.models.precision import check_attention
    from vllm_omni_like.models.registry import FAMILIES

    with pytest.raises(ConfigError) as info:
        case_of("flux").stage(dtype="bf16", attention="fp8")
    assert str(info.value) == (
        "--attention fp8 runs on CUDA (compute capability 8.9 or newer), not on cpu"
    )
    config = StageConfig(name="diffusion", kind="diffusion", model="tiny-image", attention="fp8")
    with pytest.raises(ConfigError) as engine_side:
        describe_stage(config)
    with pytest.raises(ConfigError) as worker_side:
        DiffusionStage(config).load("cpu")
    assert (
        str(engine_side.value)
        == str(worker_side.value)
        == (
            "stage 'diffusion': --attention fp8 runs the families whose attention diffusers "
            "dispatches (flux, qwen-image, qwen-image-edit, z-image, wan-ti2v, wan, wan-i2v), "
            "not stable-diffusion: serve it with --attention sdpa"
        )
    )
    # processors calling SDPA themselves: refused too
    refused = {f.name for f in FAMILIES if f.fp8 and not f.fp8_attention}
    assert refused == {"stable-diffusion-3"}
    for family in FAMILIES:
        if family.name in refused:
            with pytest.raises(ConfigError, match=f"not {family.name}: serve it with"):
                check_attention("d", family, "fp8")
        check_attention("d", family, "sdpa")  # (nothing to refuse)


def test_sequence_parallelism_is_refused_at_start_up():
    """Its ranks' Ulysses processors (models/*/sequence_parallel.py) call SDPA in place of the
    FP8-routed ones: refused when the config is built, before anything loads."""
    kw = {"name": "diffusion", "kind": "diffusion", "model": "tiny-image", "device": "cpu"}
    with pytest.raises(ConfigError) as info:
        StageConfig(**kw, attention="fp8", sequence_parallel=2)
    assert str(info.value) == (
        "stage 'diffusion': --attention fp8: not with --sequence-parallel 2 (a "
        "sequence-parallel rank's attention is its family's Ulysses processor, which calls "
        "PyTorch SDPA: no FP8 attention would run); use --attention sdpa with it"
    )
    assert StageConfig(**kw, attention="sdpa", sequence_parallel=2).sequence_parallel == 2
    assert StageConfig(**kw, attention="fp8").attention == "fp8"


def test_a_cuda_device_below_8_9_and_fp16_are_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100 80GB")
    with pytest.raises(ConfigError) as info:
        fa.check_fp8_attention(torch.device("cuda"), torch.bfloat16)
    assert str(info.value) == (
        "--attention fp8 needs CUDA compute capability 8.9 or newer (Ada, Hopper); "
        "NVIDIA A100 80GB is 8.0"
    )
    monkeypatch.setattr(fa, "fp8_attention_problem", lambda device: None)  # (an H100, say)
    with pytest.raises(ConfigError) as info:
        fa.check_fp8_attention(torch.device("cuda"), torch.float16)
    assert str(info.value) == (
        "--attention fp8 runs bf16 activations (its kernel reads and writes bf16): use --dtype "
        "bf16 or auto, not float16"
    )
    fa.check_fp8_attention(torch.device("cuda"), torch.bfloat16)
    config = StageConfig(name="d", kind="diffusion", model="tiny-image", attention="fp8")
    assert quantize.gpu_dtype(config) == torch.bfloat16  # so `--dtype auto` gives bf16


def test_a_triton_that_cannot_build_the_kernel_is_refused_with_its_words(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

    def broken(device):
        raise RuntimeError("PassManager::run failed\nmore")

    monkeypatch.setattr(fa, "kernel_agreement", broken)
    assert fa.fp8_attention_problem(torch.device("cuda")) == (
        "--attention fp8: the Triton kernel does not run here: RuntimeError: PassManager::run "
        "failed"
    )
    monkeypatch.setattr(fa, "kernel_agreement", lambda device: 39.96)
    assert fa.fp8_attention_problem(torch.device("cuda")) == (
        "--attention fp8: the Triton kernel's results differ from its emulation here "
        "(40.0 dB SQNR, not above 40)"
    )
    monkeypatch.setattr(fa, "kernel_agreement", lambda device: 47.8)
    assert fa.fp8_attention_problem(torch.device("cuda")) is None
    monkeypatch.undo()  # the check itself, run where the op is the emulation: the same output
    assert fa.kernel_agreement(torch.device("cpu")) == math.inf


def test_the_precision_a_stage_reports_with_fp8_attention():
    assert quantize.precision_of("fp8", torch.bfloat16, "fp8") == "fp8, fp8 attention"
    assert quantize.precision_of("none", torch.bfloat16, "fp8") == "bf16, fp8 attention"
    assert quantize.precision_of("none", torch.bfloat16, "sdpa") == "bf16"
