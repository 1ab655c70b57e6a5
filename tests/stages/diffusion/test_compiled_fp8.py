"""Compiled FP8 stages on the CPU (dynamo's eager backend: real tracing and guards, no C
compiler): compiled regionally by default (one graph a kind of block, reused by every block of
it), nothing compiles after the warm-up - a running set of rows joining at other steps, prompts
of new lengths (Z-Image's text buckets) - and the images are the eager FP8 stage's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo import register_backend
from torch._dynamo.utils import counters

from tests.models.tiny_mmdit import tiny_flux_path
from tests.models.tiny_z_image import tiny_z_image_path
from tests.stages.diffusion.test_compiled import _control
from tests.stages.diffusion.test_running_set import _Harness, _req
from vllm_omni_like.config import StageConfig
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.diffusion.fp8 import Fp8Linear
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.wire import StageRequest

pytestmark = pytest.mark.slow
NODES: list[int] = []  # each graph the counting backend was given: its FX nodes


@register_backend
def counting(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """Dynamo's eager backend that counts the graphs it is given, and their nodes."""
    NODES.append(len(gm.graph.nodes))
    return gm.forward


def _stage(model: str, buckets: tuple[int, ...], **config) -> DiffusionStage:
    stage = DiffusionStage(
        StageConfig(
            name="diffusion",
            kind="diffusion",
            model=model,
            compile=True,
            max_batch_size=max(buckets),
            batch_buckets=buckets,
            **config,
        )
    )
    stage.load("cpu")
    return stage


def test_a_compiled_fp8_flux_set_never_recompiles_after_its_warm_up(capfd):
    """Its blocks compiled one by one (regional: the default with FP8), the rest eager; rows
    with their own guidance scales and steps joining the set run on the warm-up's graphs, and
    each image is the eager FP8 stage's."""
    stage = _stage(tiny_flux_path(), (4,), quantization="fp8", options={"compile_backend": "eager"})
    transformer = stage.runtime.pipe.transformer
    assert type(transformer).__name__ != "OptimizedModule"
    blocks = [*transformer.transformer_blocks, *transformer.single_transformer_blocks]
    assert {type(b).__name__ for b in blocks} == {"OptimizedModule"}
    assert isinstance(transformer.single_transformer_blocks[0].proj_mlp, Fp8Linear)
    graphs = counters["stats"]["unique_graphs"]
    capfd.readouterr()
    h = _Harness(stage, lanes=1, group=(2, 0.0))
    h.add(1, _req("a", 1, 4, guidance_scale=2.0), _req("b", 2, 3))
    h.steps(1)
    h.add(2, _req("c", 3, 3, guidance_scale=5.0))  # joins at step 1: 3 rows (padded to 4)
    h.steps()
    assert sorted(h.outputs) == ["a", "b", "c"]
    assert all(o.error is None for o in h.outputs.values())
    assert counters["stats"]["unique_graphs"] == graphs  # nothing recompiled
    assert "Recompiling" not in capfd.readouterr().err
    eager = DiffusionStage(
        StageConfig(name="diffusion", kind="diffusion", model=tiny_flux_path(), quantization="fp8")
    )
    eager.load("cpu")
    alone = eager.execute([_req("a", 1, 4, guidance_scale=2.0)], _control())[0]
    diff = h.outputs["a"].images[0].pixels.astype(int) - alone.images[0].pixels.astype(int)
    assert np.abs(diff).max() <= 1


@pytest.mark.drill  # (the suite's time; the FLUX.1 test above compiles regionally too)
def test_regional_compilation_compiles_a_block_once_a_shape_not_every_block():
    """tiny-video's four Wan blocks: compiled whole, each warm-up shape is one graph of all
    four blocks; compiled regionally, one graph of one block, reused by the four."""
    found = {}
    for regional in ("off", "on"):
        NODES.clear()
        torch._dynamo.reset()
        options = {"compile_backend": "counting"}
        stage = _stage("tiny-video", (1, 2), regional_compile=regional, options=options)
        found[regional] = list(NODES)
        del stage
    shapes = len(found["off"])  # (the model-row buckets: 1, 2, 4)
    assert shapes == 3 and len(found["on"]) == shapes
    assert 3 * sum(found["on"]) < sum(found["off"])  # a block's graph, not four blocks'
    assert len(set(found["on"])) == 1  # the same block graph at each shape


@pytest.mark.drill  # (the suite's time: Z-Image's bf16 compile is tests/models/'s)
def test_prompts_of_new_lengths_run_on_a_compiled_fp8_z_images_warm_up_graphs(capfd):
    """Z-Image's blocks are compiled one by one already; with FP8 its text buckets keep every
    prompt length on the warm-up's graphs, and the images are the eager FP8 stage's."""
    plain = DiffusionStage(
        StageConfig(
            name="diffusion", kind="diffusion", model=tiny_z_image_path(), quantization="fp8"
        )
    )
    plain.load("cpu")
    fp8 = _stage(
        tiny_z_image_path(), (1,), quantization="fp8", options={"compile_backend": "eager"}
    )
    assert isinstance(fp8.runtime.pipe.transformer.layers[0].attention.to_q, Fp8Linear)
    graphs = counters["stats"]["unique_graphs"]
    capfd.readouterr()
    for prompt, guidance in (
        ("a cat", 0.0),
        ("a cat sitting on a mat in the sun", 0.0),
        ("a dog", 2.0),
    ):
        params = GenerationParams(seed=3, num_inference_steps=2, guidance_scale=guidance)
        request = StageRequest("r", prompt, params)
        got = fp8.execute([request], _control())[0].images[0].pixels.astype(int)
        want = plain.execute([request], _control())[0].images[0].pixels.astype(int)
        assert np.abs(got - want).max() <= 1
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled at run time
    assert "Recompiling" not in capfd.readouterr().err
