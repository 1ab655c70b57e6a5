"""The LoRA layer, its files and its pool without a stage: a new mix of adapters and a new
adapter written in place compile nothing again; a fused QKV projection's fused B equals the
three projections'; FP8's linear layer takes the same wrapper; diffusers' converters read
kohya-style SD1.5, SDXL and FLUX.1 files; what is not supported is refused by name."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import safetensors.torch
import torch

from tests.models.tiny_mmdit import tiny_flux_path
from tests.models.tiny_sdxl import tiny_sdxl_path
from tests.stages.diffusion.lora_helpers import low_rank, write_kohya, write_peft
from vllm_omni_like.loras import LoraSpec
from vllm_omni_like.models.precision import LORA_LAYERS
from vllm_omni_like.models.tiny import ensure_tiny_model
from vllm_omni_like.params import LoraRef
from vllm_omni_like.stages.diffusion.fp8 import Fp8Linear
from vllm_omni_like.stages.diffusion.lora_files import LoraError, read_adapter
from vllm_omni_like.stages.diffusion.lora_layers import LoraContext, LoraLinear, wrap
from vllm_omni_like.stages.diffusion.lora_pool import LoraPool, module_names


def _load(path: str):
    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(
        path, local_files_only=True, dtype=torch.float32
    )
    return pipe


def _pool(model, pipe_class, prefix, specs, rank=8, slots=2):
    context, known = LoraContext(), module_names(model)
    targets = wrap(model, LORA_LAYERS, slots + 1, rank, context, torch.float32)
    pool = LoraPool(specs, None, targets, known, (pipe_class, (prefix,)), (slots, rank, 2), context)
    return pool, context


def _rows(pool, *selections):
    return pool.rows(list(selections), torch.device("cpu"))


def test_a_new_mix_and_a_new_adapter_written_in_place_compile_nothing_again():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    context = LoraContext()
    targets = wrap(model, ("0", "2"), 3, 4, context, torch.float32)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=backend, dynamic=False)
    x = torch.randn(3, 5, 16)
    layer = targets["0"].layer
    layer.write(1, 0, torch.randn(4, 16), torch.randn(32, 4))
    outs = []
    for index, scale in [([[1, 0], [0, 0], [1, 0]], [[1.0, 0], [0, 0], [0.5, 0]])] * 2 + [
        ([[0, 0], [1, 2], [2, 1]], [[0.0, 0], [1.0, 1.0], [0.3, 0.7]])
    ]:
        with torch.no_grad(), context.rows((torch.tensor(index), torch.tensor(scale))):
            outs.append(compiled(x))
        layer.write(2, 0, torch.randn(4, 16), torch.randn(32, 4))  # (a new adapter, in place)
    assert len(graphs) == 1
    with torch.no_grad(), context.rows((torch.tensor([[1, 0]] * 3), torch.ones(3, 2))):
        eager = model(x)
        update = (x @ layer.lora_a[1].T) @ layer.lora_b[1]
        second = targets["2"].layer  # (its slot 1 holds no adapter)
        assert torch.allclose(eager, second.base(model[1](layer.base(x) + update)), atol=1e-5)
    assert not torch.equal(outs[0][1], outs[2][1])


def test_a_fused_qkv_projection_takes_a_fused_b(tmp_path):
    pipe = _load(tiny_flux_path())
    plain = pipe.transformer
    fused = copy.deepcopy(plain)
    fused.fuse_qkv_projections()
    weights = low_rank(plain, 1, 2, ends=("attn.to_q", "attn.to_k", "attn.to_v", "add_k_proj"))
    spec = LoraSpec("q", write_peft(tmp_path / "q.safetensors", weights, prefix="transformer"))
    results, x, text = [], torch.randn(2, 6, 32), torch.randn(2, 4, 32)
    for model in (plain, fused):
        pool, context = _pool(model, type(pipe), "transformer", (spec,), rank=4)
        selection = pool.acquire((LoraRef("q", 0.7),))
        attn = model.transformer_blocks[0].attn
        with torch.no_grad(), context.rows(_rows(pool, selection, ())):
            results.append(attn(x, text))
        with torch.no_grad(), context.rows(_rows(pool, (), ())):
            results.append(attn(x, text))
    fused_attn = fused.transformer_blocks[0].attn
    assert isinstance(fused_attn.to_qkv, LoraLinear) and len(fused_attn.to_qkv.parts) == 3
    for a, b in zip(results[0], results[2], strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    assert not torch.allclose(results[0][0][0], results[1][0][0])  # row 0: its adapter
    assert torch.allclose(results[0][0][1], results[1][0][1], atol=1e-6)  # row 1: none


def test_fp8_linear_layers_take_the_same_wrapper():
    torch.manual_seed(0)
    base = Fp8Linear.from_linear(torch.nn.Linear(32, 16, bias=False))  # (buffers alone)
    context = LoraContext()
    layer = LoraLinear(base, 2, 4, (16,), context, torch.float32)
    a, b = torch.randn(4, 32), torch.randn(16, 4)
    layer.write(1, 0, a, b)
    x = torch.randn(2, 3, 32)
    with torch.no_grad(), context.rows((torch.tensor([[1, 0], [0, 0]]), torch.ones(2, 2))):
        out = layer(x)
    assert torch.allclose(out[0], base(x[0]) + x[0] @ a.T @ b.T, atol=1e-4)
    assert torch.allclose(out[1], base(x[1]), atol=1e-6)


def _read(path, model, pipe_class, prefix="unet", rank=8):
    context, known = LoraContext(), module_names(model)
    targets = wrap(model, LORA_LAYERS, 2, rank, context, torch.float32)
    return read_adapter(LoraSpec("x", str(path)), pipe_class, (prefix,), targets, known, rank)


@pytest.mark.parametrize("which", ["sd15", "sdxl"])
def test_kohya_sd_files_read_as_their_peft_twins(tmp_path, which):
    pipe = _load(ensure_tiny_model("tiny-image") if which == "sd15" else tiny_sdxl_path())
    weights = low_rank(pipe.unet, 1, 4)
    kohya = _read(write_kohya(tmp_path / "k.safetensors", weights, 2.0), pipe.unet, type(pipe))
    twin = _load(ensure_tiny_model("tiny-image") if which == "sd15" else tiny_sdxl_path())
    peft = _read(write_peft(tmp_path / "p.safetensors", weights, alpha=2.0), twin.unet, type(pipe))
    assert sorted(kohya.layers) == sorted(peft.layers) == sorted(weights)
    for name, (a, b) in kohya.layers.items():
        assert torch.equal(a, peft.layers[name][0]) and torch.allclose(b, peft.layers[name][1])
        assert torch.allclose(b, weights[name][1] * 0.5)  # alpha 2 / rank 4


def test_a_kohya_flux_file_reads_through_diffusers_flux_converter(tmp_path):
    pipe = _load(tiny_flux_path())
    inner, r = 32, 2
    sd = {}
    for key, (i, o) in {
        "double_blocks_0_img_attn_qkv": (inner, 3 * inner),
        "double_blocks_0_img_mlp_0": (inner, 4 * inner),
        "single_blocks_0_linear2": (5 * inner, inner),
    }.items():
        sd[f"lora_unet_{key}.lora_down.weight"] = torch.randn(r, i)
        sd[f"lora_unet_{key}.lora_up.weight"] = torch.randn(o, r)
        sd[f"lora_unet_{key}.alpha"] = torch.tensor(1.0)
    safetensors.torch.save_file(sd, str(tmp_path / "f.safetensors"))
    got = _read(tmp_path / "f.safetensors", pipe.transformer, type(pipe), "transformer")
    assert sorted(got.layers) == [
        "single_transformer_blocks.0.proj_out",
        "transformer_blocks.0.attn.to_k",
        "transformer_blocks.0.attn.to_q",
        "transformer_blocks.0.attn.to_v",
        "transformer_blocks.0.ff.net.0.proj",
    ]


def _refusal(tmp_path, tensors, match, name="r.safetensors", rank=8):
    pipe = _load(ensure_tiny_model("tiny-image"))
    path = tmp_path / name
    safetensors.torch.save_file(tensors, str(path))
    with pytest.raises(LoraError, match=match):
        _read(path, pipe.unet, type(pipe), rank=rank)


BLOCK = "down_blocks.0.attentions.0.transformer_blocks.0"


@pytest.mark.parametrize(
    ("tensors", "match", "rank"),
    [
        (
            {
                "lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight": (4, 32),
                "lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight": (32, 4),
            },
            r"text-encoder LoRA keys are not supported \(text_encoder\)",
            8,
        ),
        (
            {
                "lora_unet_down_blocks_0_resnets_0_conv1.lora_down.weight": (4, 64, 3, 3),
                "lora_unet_down_blocks_0_resnets_0_conv1.lora_up.weight": (64, 4, 1, 1),
            },
            r"down_blocks.0.resnets.0.conv1 is a convolution \(LoCon\): not supported",
            8,
        ),
        (
            {f"unet.{BLOCK}.attn9.to_q.lora_A.weight": (4, 64)}
            | {f"unet.{BLOCK}.attn9.to_q.lora_B.weight": (64, 4)},
            "the base model has no module .*attn9.to_q",
            8,
        ),
        (
            {f"unet.{BLOCK}.attn1.to_q.lora_A.weight": (16, 64)}
            | {f"unet.{BLOCK}.attn1.to_q.lora_B.weight": (64, 16)},
            "rank 16 of .*attn1.to_q is over --max-lora-rank 8",
            8,
        ),
        (
            {f"unet.{BLOCK}.attn1.to_q.lora_A.weight": (4, 64)}
            | {f"unet.{BLOCK}.attn1.to_q.lora_B.weight": (64, 4)}
            | {f"unet.{BLOCK}.attn1.to_q.lora_magnitude_vector": (64,)},
            "is DoRA",
            8,
        ),
    ],
)
def test_what_is_not_supported_is_refused_by_name(tmp_path, tensors, match, rank):
    _refusal(tmp_path, {k: torch.randn(*s) for k, s in tensors.items()}, match, rank=rank)


def test_a_second_experts_keys_on_a_model_of_one_are_refused_by_name(tmp_path):
    """`transformer_2.` keys (a Wan2.2-A14B adapter's low-noise half) on a model of one expert."""
    pipe = _load(ensure_tiny_model("tiny-video"))
    weights = low_rank(pipe.transformer, 1, 4, ends=("attn1.to_q",))
    path = write_peft(tmp_path / "a14b.safetensors", weights, prefix="transformer_2")
    with pytest.raises(LoraError) as info:
        _read(path, pipe.transformer, type(pipe), "transformer")
    assert str(info.value) == (
        "LoRA 'x': key 'transformer_2.blocks.0.attn1.to_q.lora_A.weight' is not of the transformer"
    )


def test_a_pickle_file_is_refused_unread_and_a_broken_one_named(tmp_path):
    pipe = _load(ensure_tiny_model("tiny-image"))
    (tmp_path / "x.ckpt").write_bytes(b"not read")
    with pytest.raises(LoraError, match=r"x\.ckpt is a pickle file"):
        _read(tmp_path / "x.ckpt", pipe.unet, type(pipe))
    (tmp_path / "y.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(LoraError, match=r"y\.safetensors cannot be read as safetensors"):
        _read(tmp_path / "y.safetensors", pipe.unet, type(pipe))


READ_THEN_TRUNCATE = """
import sys
from vllm_omni_like.loras import LoraSpec
from vllm_omni_like.stages.diffusion import lora_files
tensors, meta = lora_files._load(LoraSpec("x", sys.argv[1]))
open(sys.argv[1], "r+b").truncate(0)  # (the file replaced under the read's tensors)
print(meta["default_steps"], float(tensors["a"].abs().sum()) > 0)
"""


def test_a_file_truncated_under_its_read_tensors_does_not_fault_the_worker(tmp_path):
    """The read holds the file's bytes, not a mapping of it (safetensors' `load_file` maps
    it): with a mapping, a file truncated while its tensors are read - a deploy replacing
    adapters beside a request's read - killed the process with SIGBUS (exit -7)."""
    path = str(tmp_path / "x.safetensors")
    safetensors.torch.save_file({"a": torch.randn(256, 256)}, path, {"default_steps": "4"})
    done = subprocess.run(
        [sys.executable, "-c", READ_THEN_TRUNCATE, path],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["4", "True"]
