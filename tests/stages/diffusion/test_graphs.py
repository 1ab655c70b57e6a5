"""The CUDA graphs of the denoiser's forward (stages/diffusion/graphs.py), on the CPU: a replay
double stands in for a graph. It records the captured call and, on each replay, re-runs it over
the static buffers - what a real replay computes from them - then poisons them, so a step that
does not copy every one of its inputs in computes from poison and its images differ."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import pytest
import torch

from tests.stages.diffusion.test_compiled import _compiled_stage
from tests.stages.diffusion.test_running_set import _Harness, _req
from vllm_omni_like.config import StageConfig
from vllm_omni_like.errors import ConfigError
from vllm_omni_like.outputs import StageOutput
from vllm_omni_like.stages.diffusion import load
from vllm_omni_like.stages.diffusion.graphs import GraphRunner, backend_for
from vllm_omni_like.stages.diffusion.stage import DiffusionStage


def _poison(t: torch.Tensor) -> None:
    if t.is_floating_point():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.logical_not_()
    else:
        t.add_(7)


class _Replay:
    def __init__(self, run, buffers, output, owner) -> None:
        self.run, self.buffers, self.output, self.owner = run, buffers, output, owner

    def replay(self) -> None:
        self.output.copy_(self.run())
        self.owner.replays += 1
        self.poison()

    def poison(self) -> None:
        for buffer in self.buffers.values():
            _poison(buffer)


class PoisoningGraphs:
    """A graph backend for the CPU: a capture runs the call once over the buffers (as a CUDA
    capture would record it) and poisons the buffers and the output; a replay re-runs it, then
    poisons the buffers again."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.captures = self.replays = 0

    def capture(self, run: Callable[[], torch.Tensor], buffers: dict[str, torch.Tensor]):
        output = run()
        self.captures += 1
        graph = _Replay(run, buffers, output, self)
        graph.poison()
        _poison(output)
        return graph, output

    def memory(self) -> int:
        return 0


class FailingGraphs(PoisoningGraphs):
    def capture(self, run, buffers):
        raise RuntimeError("operation not permitted when stream is capturing")


@pytest.fixture(scope="module")
def graphed():
    """A compiled tiny model (the eager backend) whose warm-up captured its buckets' forwards
    into poisoning doubles; the double."""
    double = PoisoningGraphs()
    patch = pytest.MonkeyPatch()
    patch.setattr(load, "backend_for", lambda config, device: double)
    try:
        stage = _compiled_stage(4, (4,))  # (model rows 4 and 8: one image bucket, CFG or not)
    finally:
        patch.undo()
    return stage, double


def _run(stage) -> tuple[dict[str, StageOutput], int]:
    """Rows of their own steps and seeds, joining at other steps (the bucket's padding changes
    under them), one without guidance; each request's output, and the steps run."""
    h = _Harness(stage, lanes=1, group=(4, 0.0))
    h.add(1, _req("a", 1, 5), _req("b", 2, 3))
    h.steps(2)
    h.add(2, _req("c", 3, 4, guidance_scale=1.0))  # joins at step 2: 3 rows, padded
    h.steps(1)
    h.add(3, _req("d", 4, 3, prompt="a blue square"))
    h.steps()
    return h.outputs, len(h.stepped)


def _images(outputs: dict[str, StageOutput]) -> dict[str, np.ndarray]:
    assert sorted(outputs) == ["a", "b", "c", "d"]
    assert all(o.error is None for o in outputs.values()), outputs
    return {rid: out.images[0].pixels for rid, out in outputs.items()}


@pytest.mark.slow
def test_every_input_is_copied_into_the_graph_each_step(graphed, monkeypatch):
    """Each bucket's forward was captured at the warm-up; requests replay the graphs (no
    capture after the warm-up) and make exactly the images of the same compiled model run
    without graphs, though every replay poisoned every static input after it. The test is
    sensitive: a runner that leaves any one input out of its copies replays over poison."""
    stage, double = graphed
    runner = stage.runtime.denoise.graphs
    captured = double.captures
    assert captured == 2 and stage.cuda_graphs()[0] == runner.labels() == ("4x4x16x16", "8x4x16x16")
    replays = double.replays
    outputs, steps = _run(stage)
    with_graphs = _images(outputs)
    assert double.captures == captured  # nothing captured for a request
    assert double.replays == replays + steps  # every step replayed its bucket's graph
    stage.runtime.denoise.graphs = GraphRunner()  # the compiled forward itself
    try:
        alone = _images(_run(stage)[0])
    finally:
        stage.runtime.denoise.graphs = runner
    for rid, pixels in alone.items():
        np.testing.assert_array_equal(with_graphs[rid], pixels)
    copy_in = GraphRunner._copy_in
    for skipped in ("times", "latents", "text"):

        def leaky(self, buffers, flat, skipped=skipped):
            copy_in(self, buffers, {k: v for k, v in flat.items() if k != skipped})

        monkeypatch.setattr(GraphRunner, "_copy_in", leaky)
        h = _Harness(stage, lanes=1, group=(4, 0.0))
        h.add(1, _req("a", 1, 5), _req("b", 2, 3))  # (b's steps: as above)
        h.steps(3)
        assert h.outputs["b"].error is not None or not np.array_equal(
            h.outputs["b"].images[0].pixels, alone["b"]
        ), skipped
        h.steps()


def _forward(inputs):
    return inputs["latents"] * 2 + inputs["times"][:, None]


def _inputs(rows: int, fill: float) -> dict:
    return {"latents": torch.full((rows, 3), fill), "times": torch.arange(float(rows)), "x": None}


def test_a_forward_is_captured_on_its_second_sight_while_warming_up_only():
    double = PoisoningGraphs()
    runner = GraphRunner(double)
    runner.forward(_inputs(2, 1.0), _forward)  # seen, not warming: runs
    assert double.captures == 0
    with runner.warm_up():
        first = runner.forward(_inputs(4, 1.0), _forward)  # first sight: compiled, autotuned
        assert double.captures == 0
        second = runner.forward(_inputs(4, 3.0), _forward)  # second: captured and replayed
    assert double.captures == 1 and runner.labels() == ("4x3",)
    torch.testing.assert_close(first, _forward(_inputs(4, 1.0)))
    torch.testing.assert_close(second, _forward(_inputs(4, 3.0)))
    out = runner.forward(_inputs(4, 5.0), _forward)  # replayed, with its own values
    torch.testing.assert_close(out, _forward(_inputs(4, 5.0)))
    out.fill_(0)  # the caller's own tensor: the next replay does not write over it
    again = runner.forward(_inputs(4, 6.0), _forward)
    assert out.abs().sum() == 0 and runner.replays == 3
    torch.testing.assert_close(again, _forward(_inputs(4, 6.0)))
    runner.forward(_inputs(2, 1.0), _forward)  # seen while not warming: never captured
    assert double.captures == 1


def test_a_forward_with_a_host_value_is_never_captured():
    """Inputs that are not all tensors on the graphs' device (a host list, a tensor elsewhere)
    run the forward itself; so does one the step marks not replayable (host timesteps)."""
    double = PoisoningGraphs()
    double.device = torch.device("meta")  # (every tensor here is elsewhere)
    runner = GraphRunner(double)
    with runner.warm_up():
        for _ in range(3):
            runner.forward(_inputs(2, 1.0), _forward)
    runner.backend = double = PoisoningGraphs()
    with runner.warm_up():
        for _ in range(3):
            runner.forward({**_inputs(2, 1.0), "lengths": [3, 4]}, _forward)
            runner.forward(_inputs(2, 1.0), _forward, replayable=False)
    assert double.captures == 0 and runner.labels() == ()


def test_a_capture_that_fails_falls_back_to_the_compiled_forward_with_a_warning(caplog):
    caplog.set_level(logging.WARNING)
    runner = GraphRunner(FailingGraphs(), stage="diffusion")
    with runner.warm_up():
        for fill in (1.0, 2.0, 3.0):
            out = runner.forward(_inputs(2, fill), _forward)
            torch.testing.assert_close(out, _forward(_inputs(2, fill)))
    assert runner.labels() == () and runner.replays == 0
    (record,) = [r for r in caplog.records if "CUDA graph" in r.getMessage()]
    assert record.getMessage() == (
        "stage diffusion: the CUDA graph of the forward 2x3 failed (RuntimeError: operation "
        "not permitted when stream is capturing); it runs the compiled forward"
    )


def test_which_stages_capture_graphs():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")

    def config(**kw) -> StageConfig:
        return StageConfig(name="d", kind="diffusion", compile=True, **kw)

    assert backend_for(config(), cpu) is None  # auto: CUDA only
    assert backend_for(config(cuda_graphs="off"), cuda) is None
    assert backend_for(config(cfg_parallel=True, devices=("cpu", "cpu")), cuda) is None
    assert backend_for(StageConfig(name="d", kind="diffusion"), cuda) is None  # not compiled
    with pytest.raises(ConfigError, match="--cuda-graphs on needs CUDA, not cpu"):
        backend_for(config(cuda_graphs="on"), cpu)
    # a step cache decides between the blocks, eager: auto leaves the graphs off (and `on` is
    # refused at start-up: tests/test_speed_settings.py)
    assert backend_for(config(cache="first-block"), cpu) is None
    assert backend_for(config(cache="first-block"), torch.device("meta")) is None


def _named(inputs):
    """A forward over every kind of input a family hands the step: named text tensors (float
    embeddings, a bool mask, integer lengths) and a guidance embedding's scales."""
    text = inputs["text"]
    masked = (text["embeds"] * text["mask"][..., None]).sum(1)
    per_row = masked * text["lengths"][:, None] + inputs["guidance"][:, None]
    return inputs["latents"] * inputs["times"][:, None] + per_row


def _named_inputs(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    text = {
        "embeds": torch.randn(3, 5, 4, generator=g),
        "mask": torch.rand(3, 5, generator=g) > 0.5,
        "lengths": torch.randint(1, 5, (3,), generator=g),
    }
    guidance = torch.rand(3, generator=g)
    return {
        "latents": torch.randn(3, 4, generator=g),
        "times": torch.rand(3, generator=g),
        "text": text,
        "guidance": guidance,
        "conditioning": None,
    }


def test_named_text_masks_lengths_and_guidance_are_copied_in_each_replay(monkeypatch):
    """Every kind of input - a dict of text tensors (a bool mask, integer lengths), a guidance
    embedding's scales - is copied into its buffer at each replay: with the poisoning double
    each replay equals the forward itself, and leaving any one out is seen."""
    double = PoisoningGraphs()
    runner = GraphRunner(double)
    with runner.warm_up():
        runner.forward(_named_inputs(0), _named)
        runner.forward(_named_inputs(1), _named)
    assert double.captures == 1
    for seed in range(2, 5):
        torch.testing.assert_close(
            runner.forward(_named_inputs(seed), _named), _named(_named_inputs(seed))
        )
    copy_in = GraphRunner._copy_in
    for skipped in ("latents", "times", "text.embeds", "text.mask", "text.lengths", "guidance"):

        def leaky(self, buffers, flat, skipped=skipped):
            copy_in(self, buffers, {k: v for k, v in flat.items() if k != skipped})

        monkeypatch.setattr(GraphRunner, "_copy_in", leaky)
        got = runner.forward(_named_inputs(9), _named)
        assert not torch.allclose(got, _named(_named_inputs(9)), equal_nan=False), skipped


@pytest.mark.slow
def test_lora_rows_are_static_inputs_copied_into_the_graph_each_step(tmp_path, monkeypatch):
    """With LoRA adapters each model row's slots and scales are inputs of the captured graph:
    a batch mixing adapters replays its bucket's graph and makes exactly the
    images of the same compiled stage without graphs (test_lora: each row its solo image), though
    every replay poisoned its inputs;
    a runner that leaves the slots or the scales out of its copies does not."""
    from tests.stages.diffusion.lora_helpers import (
        lora_request,
        low_rank,
        run_images,
        tiny_image_pipe,
        write_peft,
    )
    from vllm_omni_like.params import LoraRef

    unet = tiny_image_pipe().unet
    a = write_peft(tmp_path / "a.safetensors", low_rank(unet, 1, 4))
    b = write_peft(tmp_path / "b.safetensors", low_rank(unet, 2, 8), alpha=4.0)
    double = PoisoningGraphs()
    monkeypatch.setattr(load, "backend_for", lambda config, device: double)
    config = StageConfig(
        name="diffusion",
        kind="diffusion",
        model="tiny-image",
        dtype="float32",
        compile=True,
        max_batch_size=4,
        batch_buckets=(4,),
        loras=(f"a={a}", f"b={b}"),
        max_lora_rank=8,
        options={"compile_backend": "eager"},
    )
    stage = DiffusionStage(config)
    stage.load("cpu")
    monkeypatch.undo()
    try:
        runner = stage.runtime.denoise.graphs
        assert double.captures == 2 and all(
            {"lora.index", "lora.scale"} <= {k[0] for k in key} for key in runner.graphs
        )
        batch = [
            lora_request("a", (LoraRef("a"),), num_inference_steps=2),
            lora_request("ab", (LoraRef("a"), LoraRef("b", 0.8)), seed=5, num_inference_steps=2),
        ]
        replays = double.replays
        graphed = run_images(stage, batch)
        assert double.replays > replays and double.captures == 2
        stage.runtime.denoise.graphs = GraphRunner()  # the compiled forward itself
        alone = run_images(stage, batch)
        stage.runtime.denoise.graphs = runner
        for rid in ("a", "ab"):
            np.testing.assert_array_equal(graphed[rid], alone[rid])
        copy_in = GraphRunner._copy_in
        for skipped in ("lora.index", "lora.scale"):

            def leaky(self, buffers, flat, skipped=skipped):
                copy_in(self, buffers, {k: v for k, v in flat.items() if k != skipped})

            monkeypatch.setattr(GraphRunner, "_copy_in", leaky)
            try:
                leaked = run_images(stage, batch[1:2])["a"]
            except Exception:  # (poisoned slots index past the pool: the replay raises)
                continue
            assert not np.array_equal(leaked, alone["a"]), skipped
    finally:
        stage.close()
