"""CUDA graphs of the compiled forward (stages/diffusion/graphs.py) on a GPU; skipped where CUDA
is absent. Images with graphs equal those of the same compiled model without them, the running
set (rows joining at other steps, padding, rows without guidance) replays the warm-up's graphs
and captures nothing, and a capture that fails falls back to the compiled forward."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from tests.stages.diffusion.test_running_set import _Harness, _req
from vllm_omni_like.config import StageConfig
from vllm_omni_like.stages.diffusion.graphs import CudaGraphs, GraphRunner
from vllm_omni_like.stages.diffusion.stage import DiffusionStage

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def graphed() -> DiffusionStage:
    stage = DiffusionStage(
        StageConfig(
            name="diffusion",
            kind="diffusion",
            model="tiny-image",
            compile=True,
            cuda_graphs="on",
            max_batch_size=4,
            batch_buckets=(1, 4),
        )
    )
    stage.load("cuda")
    return stage


def _run(stage: DiffusionStage) -> tuple[dict[str, np.ndarray], int]:
    h = _Harness(stage, lanes=1, group=(4, 0.0))
    h.add(1, _req("a", 1, 6), _req("b", 2, 4))
    h.steps(2)
    h.add(2, _req("c", 3, 5, guidance_scale=1.0))  # joins at step 2 without guidance: padded
    h.steps(1)
    h.add(3, _req("d", 4, 3, prompt="a blue square"))
    h.steps()
    assert sorted(h.outputs) == ["a", "b", "c", "d"]
    assert all(o.error is None for o in h.outputs.values()), h.outputs
    return {r: o.images[0].pixels for r, o in h.outputs.items()}, len(h.stepped)


def test_a_running_set_with_graphs_makes_the_images_it_makes_without(graphed):
    runner = graphed.runtime.denoise.graphs
    assert isinstance(runner.backend, CudaGraphs)
    labels, held = graphed.cuda_graphs()
    assert labels == runner.labels() and len(labels) == 4  # model rows 1, 4 and (CFG) 2, 8
    assert held == runner.memory() > 0  # (one pool for all)
    replays = runner.replays
    with_graphs, steps = _run(graphed)
    assert runner.replays == replays + steps and runner.labels() == labels  # none captured
    graphed.runtime.denoise.graphs = GraphRunner()
    try:
        without, _ = _run(graphed)
    finally:
        graphed.runtime.denoise.graphs = runner
    for rid, pixels in without.items():
        diff = np.abs(with_graphs[rid].astype(int) - pixels.astype(int))
        assert diff.max() <= 1, rid  # the same kernels, replayed


def test_a_forward_that_syncs_falls_back_to_running_with_a_warning(caplog):
    """A forward that reads a value on the host cannot be captured: the capture fails, a
    warning says so, and the forward runs as it is, on a device that still works."""
    caplog.set_level(logging.WARNING)
    device = torch.device("cuda")
    runner = GraphRunner(CudaGraphs(device))

    def forward(inputs):
        x = inputs["latents"]
        return x * float(x.sum().item())  # (a sync: not permitted while capturing)

    latents = torch.ones(2, 3, device=device)
    with runner.warm_up():
        for _ in range(3):
            out = runner.forward({"latents": latents}, forward)
            torch.testing.assert_close(out, latents * 6.0)
    assert runner.labels() == () and "the CUDA graph of the forward 2x3 failed" in caplog.text
    torch.testing.assert_close(latents @ latents.T, torch.full((2, 2), 3.0, device=device))
    # the device's generator draws again (a failed capture left it "capturing": every later
    # draw raised "Offset increment outside graph capture", on an H100)
    assert torch.randn(4, device=device).isfinite().all()


def test_buckets_share_one_pool_and_replay_in_any_order():
    """Two buckets' graphs in one memory pool, replayed alternately with new values: each
    output is its own inputs' (a replay of one bucket never overwrites another's output)."""
    device = torch.device("cuda")
    weight = torch.randn(64, 64, device=device)
    runner = GraphRunner(CudaGraphs(device))

    def forward(inputs):
        hidden = torch.relu(inputs["latents"] @ weight) * inputs["times"][:, None]
        return hidden @ weight.T + inputs["text"]["embeds"].sum(1)

    def inputs(rows: int, seed: int) -> dict:
        g = torch.Generator(device=device).manual_seed(seed)
        latents = torch.randn(rows, 64, device=device, generator=g)
        times = torch.rand(rows, device=device, generator=g)
        embeds = torch.randn(rows, 3, 64, device=device, generator=g)
        return {"latents": latents, "times": times, "text": {"embeds": embeds}}

    with runner.warm_up():
        for rows in (2, 8):
            for seed in (0, 1):
                runner.forward(inputs(rows, seed), forward)
    assert runner.labels() == ("2x64", "8x64")
    outs = [
        (rows, seed, runner.forward(inputs(rows, seed), forward))
        for seed in range(2, 6)
        for rows in (2, 8)
    ]
    for rows, seed, out in outs:
        torch.testing.assert_close(out, forward(inputs(rows, seed)))
    assert runner.replays == 2 + len(outs)
