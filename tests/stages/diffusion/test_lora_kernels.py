"""The LoRA update's two kernels (stages/diffusion/lora_kernels.py): each equals a row-by-row
reference for mixes of adapters, K slots a row, slot 0, scale 0, a row's slot named twice and
CFG's row pairs; a fused projection's block-diagonal B alike; a new mix compiles nothing again
(dynamo's counters, aot_eager); the rule that picks one, and a stage's build taking it (a
drill: the same images from either)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from tests.stages.diffusion.lora_helpers import load_lora_stage, lora_request, run_images
from vllm_omni_like.params import LoraRef
from vllm_omni_like.stages.diffusion.lora_kernels import KERNELS, UPDATES, choose
from vllm_omni_like.stages.diffusion.lora_layers import LoraContext, LoraLinear

# rows 0-1 a CFG pair of one request (the same slots), a row of two adapters, a row of none, a
# row of one at scale 0, a row naming slot 2 twice, a row of three
INDEX = [[1, 0, 0], [1, 0, 0], [2, 3, 0], [0, 0, 0], [3, 0, 0], [2, 2, 0], [3, 1, 2]]
SCALE = [[0.8, 0, 0], [0.8, 0, 0], [1.0, 0.5, 0], [0, 0, 0], [0.0, 0, 0], [0.3, 0.4, 0]]
SCALE += [[1.0, -0.7, 0.2]]


def _pool(slots=4, wide=6, inp=12, out=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(slots, wide, inp, generator=g, dtype=torch.float64)
    b = torch.randn(slots, wide, out, generator=g, dtype=torch.float64)
    a[0], b[0] = 0, 0  # (slot 0: no adapter)
    return a, b


def _reference(x, a, b, index, scale):
    """Row by row, slot by slot: sum_k scale * x A^T B."""
    rows = []
    for r in range(x.shape[0]):
        update = torch.zeros(x.shape[1], b.shape[2], dtype=x.dtype)
        for slot, s in zip(index[r].tolist(), scale[r].tolist(), strict=True):
            update += s * (x[r] @ a[slot].T) @ b[slot]
        rows.append(update)
    return torch.stack(rows)


@pytest.mark.parametrize("kernel", KERNELS)
def test_each_kernel_equals_the_row_by_row_reference(kernel):
    a, b = _pool()
    x = torch.randn(len(INDEX), 5, 12, generator=torch.Generator().manual_seed(1))
    index, scale = torch.tensor(INDEX), torch.tensor(SCALE)
    want = _reference(x.double(), a, b, index, scale)
    got = UPDATES[kernel](x, a.float(), b.float(), index, scale)
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-5)
    assert torch.equal(got[3], torch.zeros_like(got[3])) and torch.equal(got[4], got[3])


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_fused_projection_takes_a_block_diagonal_b_in_either_kernel(kernel):
    torch.manual_seed(0)
    context, parts = LoraContext(), (8, 4, 4)  # (q, k, v of a fused to_qkv)
    layer = LoraLinear(torch.nn.Linear(12, 16), 3, 3, parts, context, torch.float32, kernel)
    written = {(1, 0): (torch.randn(3, 12), torch.randn(8, 3))}
    written[(1, 2)] = torch.randn(2, 12), torch.randn(4, 2)  # (a lower rank: padded)
    written[(2, 1)] = torch.randn(3, 12), torch.randn(4, 3)
    for (slot, part), (pa, pb) in written.items():
        layer.write(slot, part, pa, pb)
    x, index = torch.randn(3, 5, 12), torch.tensor([[1, 2], [2, 0], [0, 0]])
    scale = torch.tensor([[0.5, 2.0], [1.0, 0.0], [0.0, 0.0]])
    with torch.no_grad(), context.rows((index, scale)):
        got = layer(x)
    tops = (0, 8, 12)
    for r in range(3):
        want = layer.base(x[r])
        for slot, s in zip(index[r].tolist(), scale[r].tolist(), strict=True):
            for (at, part), (pa, pb) in written.items():
                if at == slot:
                    rows = slice(tops[part], tops[part] + parts[part])
                    want[:, rows] += s * (x[r] @ pa.T) @ pb.T
        assert torch.allclose(got[r], want, atol=1e-5), r


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_new_mix_compiles_nothing_again(kernel):
    torch.manual_seed(0)
    context = LoraContext()
    layer = LoraLinear(torch.nn.Linear(8, 8), 4, 2, (8,), context, torch.float32, kernel)
    for slot in (1, 2, 3):
        layer.write(slot, 0, torch.randn(2, 8), torch.randn(8, 2))
    compiled = torch.compile(layer, backend="aot_eager", dynamic=False)
    x = torch.randn(3, 4, 8)
    counters.clear()
    torch._dynamo.reset()
    outs = []
    for index, scale in [
        ([[1, 0], [0, 0], [1, 0]], [[1.0, 0], [0, 0], [0.5, 0]]),
        ([[0, 0], [3, 2], [2, 1]], [[0.0, 0], [1.0, 1.0], [0.3, 0.7]]),
        ([[3, 3], [1, 1], [2, 2]], [[0.2, 0.2], [1.0, 0.0], [0.0, 0.0]]),
    ]:
        rows = torch.tensor(index), torch.tensor(scale)
        with torch.no_grad(), context.rows(rows):
            outs.append(compiled(x))
            assert torch.allclose(outs[-1], layer(x), atol=1e-6)
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["recompiles"]
    assert not torch.equal(outs[0], outs[1])


def _stage(lora_files, max_loras):
    loras = (f"b={lora_files['b']}",)
    return load_lora_stage("tiny-image", loras, 8, max_loras=max_loras, max_loras_per_request=2)


def test_the_rule_pools_where_it_costs_no_more_multiply_adds_and_the_build_takes_it(lora_files):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert [choose(m, 4, cpu) for m in (1, 4, 5, 8)] == ["pooled", "pooled", "gather", "gather"]
    # (an H100 measured the gather faster at every pool size: bench/results/lora_kernels-h100)
    assert [choose(m, 4, cuda) for m in (1, 4, 5, 8)] == ["gather"] * 4
    stage = _stage(lora_files, 2)
    try:
        pool = stage.runtime.denoise.loras
        assert pool is not None and pool.layers
        assert {layer.kernel for layer in pool.layers} == {"pooled"}
    finally:
        stage.close()


@pytest.mark.drill
def test_either_kernel_through_a_stage_makes_the_same_images(lora_files):
    """One batch (an adapter's row and the base's, CFG's rows in one forward) on a stage whose
    pool pools and on one whose pool gathers."""
    batch = [lora_request("base"), lora_request("b", (LoraRef("b", 0.8),), seed=4)]
    images = {}
    for max_loras, kernel in ((2, "pooled"), (8, "gather")):
        stage = _stage(lora_files, max_loras)
        try:
            pool = stage.runtime.denoise.loras
            assert pool is not None and {layer.kernel for layer in pool.layers} == {kernel}
            images[kernel] = run_images(stage, batch)
        finally:
            stage.close()
    for r in batch:
        diff = np.abs(images["pooled"][r.request_id] - images["gather"][r.request_id])
        assert diff.max() <= 1, r.request_id
    assert np.abs(images["gather"]["b"] - images["gather"]["base"]).mean() > 5
