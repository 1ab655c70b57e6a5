"""The MMDiT families beyond the contract suite (tests/models/test_family_contract.py): the
shipped architectures have the published sizes and build in their dtype, FLUX.1-schnell (no
guidance embedding) and sizes other than the default (FLUX's shift and packing) equal the
pipeline, rows of one batch with their own guidance, steps and seeds equal each run alone,
and edits (img2img, inpaint) go through the families' diffusers pipelines."""

from __future__ import annotations

import json
import os

import diffusers
import numpy as np
import pytest
import torch
import transformers
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode

from tests.models.tiny_mmdit import tiny_flux_path, tiny_sd3_path
from vllm_omni_like.config import StageConfig
from vllm_omni_like.models.adapter import adapter_for
from vllm_omni_like.models.registry import family_of
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.pipelines.catalog import arch_path
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.stages.torch_utils import random_diffusers_components, tensor_to_uint8
from vllm_omni_like.wire import StageRequest

pytestmark = pytest.mark.slow

# published sizes (weights in the checkpoints, SD3's positional table included)
PUBLISHED = {
    ("flux.1-dev", "transformer"): 11_901_408_320,  # "12B"
    ("flux.1-schnell", "transformer"): 12.0e9,
    ("sd3.5-large", "transformer"): 8.1e9,
    ("sd3.5-medium", "transformer"): 2.5e9,
    ("flux.1-dev", "text_encoder_2"): 4_762_310_656,  # T5-v1.1-XXL's encoder
    ("sd3.5-large", "text_encoder_3"): 4_762_310_656,
    ("flux.1-dev", "text_encoder"): 123_060_480,  # CLIP ViT-L/14's text model
    ("sd3.5-large", "text_encoder_2"): 694.7e6,  # OpenCLIP ViT-bigG/14's, with projection
    ("flux.1-dev", "vae"): 83_819_683,
    ("qwen-image", "transformer"): 20.43e9,  # "20B MMDiT"
    ("qwen-image", "text_encoder"): 8.29e9,  # Qwen2.5-VL-7B-Instruct
    ("qwen-image", "vae"): 126.9e6,
    ("qwen-image-edit", "transformer"): 20.43e9,  # Qwen-Image's, fine-tuned to edit
    ("qwen-image-edit", "text_encoder"): 8.29e9,
    ("z-image-turbo", "transformer"): 6.15e9,  # "6B"
    ("z-image-turbo", "text_encoder"): 4.02e9,  # Qwen3-4B
}


def _weights(arch: str, name: str) -> int:
    """What one component of a shipped architecture holds (built on the meta device)."""
    path = os.path.join(arch_path(arch), name)
    with open(os.path.join(arch_path(arch), "model_index.json")) as f:
        library, cls_name = json.load(f)[name]
    with torch.device("meta"):
        if library == "diffusers":
            cls = getattr(diffusers, cls_name)
            model = cls.from_config(cls.load_config(path))
        else:
            model = getattr(transformers, cls_name)(transformers.AutoConfig.from_pretrained(path))
    saved = set(model.state_dict())  # (parameters once each, shared ones too; saved buffers)
    buffers = sum(b.numel() for n, b in model.named_buffers() if n in saved)
    return sum(p.numel() for p in model.parameters()) + buffers


@pytest.mark.parametrize("arch,name", sorted(PUBLISHED))
def test_the_architectures_have_the_published_sizes(arch, name):
    got, want = _weights(arch, name), PUBLISHED[(arch, name)]
    assert abs(got / want - 1) < 0.015, (got, want)


def test_a_dummy_model_is_built_in_its_dtype():
    before = torch.get_default_dtype()
    parts = random_diffusers_components(tiny_flux_path(), torch.device("cpu"), torch.bfloat16)
    assert {"transformer", "vae", "text_encoder", "text_encoder_2"} <= set(parts)
    for part in parts.values():
        assert {p.dtype for p in part.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == before
    again = random_diffusers_components(tiny_flux_path(), torch.device("cpu"), torch.bfloat16)
    pairs = zip(parts["transformer"].parameters(), again["transformer"].parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)  # the same seeds: the same weights


def _stage(path: str) -> DiffusionStage:
    stage = DiffusionStage(StageConfig(name="diffusion", kind="diffusion", model=path))
    stage.load("cpu")
    return stage


def _run(stage: DiffusionStage, requests: list[StageRequest]) -> dict[str, np.ndarray]:
    outs = stage.execute(requests, StageControl(FaultInjector((), "diffusion")))
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return {o.request_id: o.images[0].pixels for o in outs}


def _pipeline(path: str):
    pipe = diffusers.DiffusionPipeline.from_pretrained(
        path, local_files_only=True, dtype=torch.float32
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and int(np.abs(a.astype(int) - b.astype(int)).max()) <= 1


SHAPES = [
    lambda: tiny_flux_path(False),
    tiny_flux_path,
    tiny_sd3_path,
    lambda: tiny_sd3_path(False),
]


@pytest.mark.parametrize("path", SHAPES, ids=["schnell", "dev", "sd3.5-medium", "sd3.5-large"])
def test_other_sizes_and_schnell_and_sd35_large_equal_the_pipeline(path):
    path = path()
    stage, pipe = _stage(path), _pipeline(path)
    adapter = adapter_for(pipe, family_of(path))
    guidance = stage.runtime.defaults.guidance
    params = GenerationParams(seed=5, num_inference_steps=3, width=80, height=48)
    got = _run(stage, [StageRequest("r", "a blue square", params)])["r"]
    with torch.inference_mode():
        want = pipe(
            prompt=["a blue square"],
            width=80,
            height=48,
            num_inference_steps=3,
            guidance_scale=guidance,
            generator=[torch.Generator().manual_seed(5)],
            max_sequence_length=adapter.text_length(),
            output_type="pt",
        ).images
    assert got.shape == (48, 80, 3) and _close(got, tensor_to_uint8(want)[0])


@pytest.mark.parametrize("path", [tiny_flux_path, tiny_sd3_path])
def test_rows_with_their_own_guidance_steps_and_seeds_equal_each_alone(path):
    stage = _stage(path())
    mixes = [(1.0, 2), (2.5, 3), (5.0, 3), (5.0, 4)]  # (SD3: 1.0 is a row without CFG)
    requests = [
        StageRequest(
            f"r{i}",
            "a red circle" if i % 2 else "a blue square",
            GenerationParams(seed=10 + i, num_inference_steps=steps, guidance_scale=scale),
        )
        for i, (scale, steps) in enumerate(mixes)
    ]
    together = _run(stage, requests)
    for r in requests:
        assert _close(together[r.request_id], _run(stage, [r])[r.request_id]), r.request_id


@pytest.mark.parametrize("path", [tiny_flux_path, tiny_sd3_path])
def test_edits_run_the_familys_image_to_image_and_inpaint_pipelines(path):
    path = path()
    stage, pipe = _stage(path), _pipeline(path)
    assert set(stage.runtime.edit_pipes) == {"edit", "inpaint"}
    image = np.zeros((64, 64, 3), dtype=np.uint8)
    image[16:48, 16:48] = (200, 30, 30)
    params = GenerationParams(seed=4, num_inference_steps=4, strength=0.75)
    edit = StageRequest("e", "a blue square", params, mode="edit", images=[image])
    got = _run(stage, [edit])["e"]
    img2img = diffusers.AutoPipelineForImage2Image.from_pipe(pipe)
    kwargs = (
        {"negative_prompt": [""]}
        if "negative_prompt" in stage.runtime.adapter.text_kwargs(["x"], [""], None)
        else {}
    )
    with torch.inference_mode():
        want = img2img(
            prompt=["a blue square"],
            image=[Image.fromarray(image)],
            strength=0.75,
            width=64,
            height=64,
            num_inference_steps=4,
            guidance_scale=stage.runtime.defaults.guidance,
            generator=[torch.Generator().manual_seed(4)],
            max_sequence_length=stage.runtime.adapter.text_length(),
            output_type="pt",
            **kwargs,
        ).images
    assert _close(got, tensor_to_uint8(want)[0])
    mask = np.zeros((64, 64), dtype=np.uint8)
    mask[:, :32] = 255
    inpaint = StageRequest("m", "a blue square", params, mode="edit", images=[image], mask=mask)
    assert _run(stage, [inpaint])["m"].shape == (64, 64, 3)


# what makes the host wait for the device on a GPU: a tensor's value read on the host
WAITS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::equal"}
WAITS |= {"aten::masked_select", "aten::_unique2", "aten::unique_consecutive"}


class WaitSpy(TorchDispatchMode):
    """Records every op run meanwhile that reads a tensor's value on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.waits: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name in WAITS:
            self.waits.append(func._schema.name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("path", [tiny_flux_path, tiny_sd3_path], ids=["flux", "sd3"])
def test_a_step_never_waits_on_the_device(path):
    """Rows with their own guidance (SD3: one without CFG) and steps: every op of three steps
    (the forward, the guidance, each row's scheduler update) runs without reading a value back."""
    from vllm_omni_like.stages.diffusion.running_set import OwnLoopSet

    stage = _stage(path())
    rowset, control = OwnLoopSet(stage.runtime), StageControl(FaultInjector((), "diffusion"))
    requests = [
        StageRequest("a", "a red circle", GenerationParams(seed=1, num_inference_steps=5)),
        StageRequest(
            "b",
            "a blue square",
            GenerationParams(seed=2, num_inference_steps=6, guidance_scale=1.0),
        ),
    ]
    rowset.join(requests, control)
    sanity = WaitSpy()
    with sanity:
        torch.tensor([1.0]).item()
    assert sanity.waits == ["aten::_local_scalar_dense"]  # (the spy sees a wait)
    spy = WaitSpy()
    with spy:
        for _ in range(3):
            assert rowset.step(control)
    assert [r.state.index for r in rowset.set.rows] == [3, 3]
    assert spy.waits == []


def test_sd35_keeps_its_projections_unfused():
    """diffusers' fused processor leaves out the QK norms (SD3.5's) and crashes on MMDiT-X's
    image-only attention (SD3.5-medium's): SD3.5 is not fused, SD3's shape (neither) is, with
    the same output."""
    import types

    from diffusers import SD3Transformer2DModel
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    from vllm_omni_like.models.sd3 import FAMILY
    from vllm_omni_like.models.sd3.adapter import SD3Adapter

    for dual in (True, False):
        model = SD3Transformer2DModel.from_pretrained(tiny_sd3_path(dual), subfolder="transformer")
        adapter = SD3Adapter(types.SimpleNamespace(transformer=model), FAMILY)
        assert adapter.fuse_qkv() is False
        assert all(type(p) is JointAttnProcessor2_0 for p in model.attn_processors.values())
    config = {**dict(model.config), "qk_norm": None, "dual_attention_layers": ()}
    torch.manual_seed(0)
    sd3 = SD3Transformer2DModel.from_config(config).eval()
    gen = torch.Generator().manual_seed(1)
    kwargs = {
        "hidden_states": torch.randn(2, 16, 8, 8, generator=gen),
        "encoder_hidden_states": torch.randn(2, 12, 64, generator=gen),
        "pooled_projections": torch.randn(2, 64, generator=gen),
        "timestep": torch.tensor([900.0, 100.0]),
        "return_dict": False,
    }
    with torch.inference_mode():
        want = sd3(**kwargs)[0]
        assert SD3Adapter(types.SimpleNamespace(transformer=sd3), FAMILY).fuse_qkv() is True
        assert (sd3(**kwargs)[0] - want).abs().max() <= 1e-5
