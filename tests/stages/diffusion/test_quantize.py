"""`--quantization fp8` at a diffusion stage's load (stages/diffusion/quantize.py) on the CPU:
each transformer family's layers FP8 by its rule, every one of them at >= 25 dB SQNR on the tiny
dummy weights, the image close to the full-precision stage's and the same at every run, the
start-up refusals with their exact messages, what the stage says of torchao."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import re
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.models.test_family_contract import _run, case_of
from vllm_omni_like.config import StageConfig
from vllm_omni_like.errors import ConfigError
from vllm_omni_like.models.registry import FAMILIES
from vllm_omni_like.stages.diffusion import quantize
from vllm_omni_like.stages.diffusion.fp8 import Fp8Linear
from vllm_omni_like.stages.diffusion.stage import DiffusionStage

FP8_FAMILIES = sorted(f.name for f in FAMILIES if f.fp8)
# the PSNR (dB) of a request's image (a video: every frame) with FP8 against the same stage
# without, 3 steps on the CPU, the smallest over the families' tiny models minus a margin (the
# figures measured, 2026-12-06: FLUX.1 59.3, SD3 52.3, Qwen-Image 60.8, -Edit 66.6, Z-Image
# 51.9, TI2V 51.6, I2V 49.3); the trained tiny-video (wan) drifts further from its three
# steps' trajectory (21.6 dB): its drawings are checked instead (tests/shapes, the drill)
MIN_PSNR = {name: 45.0 for name in FP8_FAMILIES} | {"wan": 18.0}
# FLUX.1 by default (the suite's time: README, Development); every family with `-m drill`
EACH_FAMILY = [n if n == "flux" else pytest.param(n, marks=pytest.mark.drill) for n in FP8_FAMILIES]


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(float) - b.astype(float)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


@pytest.mark.slow
@pytest.mark.parametrize("name", FP8_FAMILIES)
def test_each_family_keeps_what_its_rule_names_and_quantizes_the_rest(name, caplog):
    caplog.set_level(logging.INFO, logger="vllm_omni_like.stages.diffusion.stage")
    case = case_of(name)
    stage = case.stage(quantization="fp8", batched_cfg=False)  # (no wrapper around them)
    rt = stage.runtime
    rule = rt.adapter.high_precision_layers()
    assert rt.precision == stage.precision() == "fp8"
    for expert in rt.adapter.experts():
        model = expert.model
        fp8 = [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
        kept = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
        assert fp8 and kept
        assert not [n for n in fp8 if quantize.keeps(n, torch.nn.Linear(16, 16), rule)]
        assert all(quantize.keeps(n, model.get_submodule(n), rule) for n in kept)
    (line,) = [r.message for r in caplog.records if "FP8 matmuls" in r.message]
    assert re.fullmatch(
        r"stage diffusion: FP8 matmuls \(rowwise, torch._scaled_mm\): transformer "
        r"[\d.]+ MiB -> [\d.]+ MiB \(\d+ linear layers FP8, \d+ kept\)",
        line,
    ), line


@pytest.mark.slow
@pytest.mark.parametrize("name", EACH_FAMILY)
def test_every_quantized_layer_keeps_25_db_on_the_dummy_weights(name):
    """Each layer the family's rule quantizes, on its own input in a real request (the tiny
    model's seeded random weights, `--load-format dummy`): its FP8 output's SQNR against its
    own >= 25 dB, the lowest over every call; the same layers the FP8 stage quantizes."""
    case = case_of(name)
    stage = case.stage(load_format="dummy", batched_cfg=False)
    rule = stage.runtime.adapter.high_precision_layers()
    expert = stage.runtime.adapter.experts()[0]
    found, remove = quantize.hooks_sqnr(expert.model, rule)
    _run(stage, case.request())
    remove()
    assert found and min(found.values()) >= 25, sorted(found.items(), key=lambda kv: kv[1])[:3]
    fp8 = case.stage(load_format="dummy", batched_cfg=False, quantization="fp8")
    model = fp8.runtime.adapter.experts()[0].model
    assert set(found) == {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


@pytest.mark.slow
@pytest.mark.parametrize("name", EACH_FAMILY)
def test_the_image_with_fp8_is_close_to_full_precision_and_the_same_every_run(name):
    case = case_of(name)
    full = _run(case.stage(), case.request())
    stage = case.stage(quantization="fp8")
    fp8 = _run(stage, case.request())
    assert np.array_equal(fp8, _run(stage, case.request()))  # deterministic
    assert _psnr(full, fp8) >= MIN_PSNR[name], _psnr(full, fp8)


@pytest.mark.slow
def test_a_batch_of_fp8_rows_gives_each_its_image_alone():
    """Activations are quantized per row (per token): a row's output does not depend on its
    batch peers, as without FP8."""
    from tests.stages.diffusion.test_running_set import _req
    from vllm_omni_like.stages.base import StageControl
    from vllm_omni_like.stages.faults import FaultInjector

    stage = case_of("flux").stage(quantization="fp8")
    reqs = [_req(f"r{i}", i, 3, guidance_scale=2.0 + i) for i in range(3)]
    control = StageControl(FaultInjector((), "diffusion"))
    together = stage.execute(reqs, control)
    for r, out in zip(reqs, together, strict=True):
        alone = stage.execute([r], control)[0]
        diff = out.images[0].pixels.astype(int) - alone.images[0].pixels.astype(int)
        assert np.abs(diff).max() <= 1


def test_a_unet_family_is_refused_at_start_up_naming_the_flag():
    from vllm_omni_like.models.generic import generic_family
    from vllm_omni_like.models.limits import describe_stage
    from vllm_omni_like.models.precision import check_quantization

    families = "stable-diffusion-3, flux, qwen-image, qwen-image-edit, z-image, wan-ti2v, wan, "
    message = (
        f"stage 'diffusion': --quantization fp8 runs the transformer families ({families}"
        "wan-i2v), not stable-diffusion: serve it with --quantization none"
    )
    config = StageConfig(name="diffusion", kind="diffusion", model="tiny-image", quantization="fp8")
    with pytest.raises(ConfigError) as engine_side:  # the engine, building its stage pools
        describe_stage(config)
    with pytest.raises(ConfigError) as worker_side:  # a stage loaded on its own
        DiffusionStage(config).load("cpu")
    assert str(engine_side.value) == str(worker_side.value) == message
    with pytest.raises(ConfigError, match=r"families \(.*\), not generic: serve it"):
        check_quantization("d", generic_family("SomePipeline", {}), "fp8")
    check_quantization("d", generic_family("SomePipeline", {}), "none")  # (nothing to refuse)


def test_a_cuda_device_below_8_9_is_refused_naming_the_flag(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100 80GB")
    with pytest.raises(ConfigError) as info:
        quantize.check_fp8(torch.device("cuda"), torch.bfloat16)
    assert str(info.value) == (
        "--quantization fp8 needs CUDA compute capability 8.9 or newer (Ada, Hopper); "
        "NVIDIA A100 80GB is 8.0"
    )


def test_fp16_activations_on_cuda_are_refused(monkeypatch):
    monkeypatch.setattr(quantize, "fp8_problem", lambda device: None)  # (an H100, say)
    with pytest.raises(ConfigError) as info:
        quantize.check_fp8(torch.device("cuda"), torch.float16)
    assert str(info.value) == (
        "--quantization fp8 on CUDA runs bf16 activations (the rowwise FP8 kernels write "
        "bf16): use --dtype bf16 or auto, not float16"
    )
    quantize.check_fp8(torch.device("cuda"), torch.bfloat16)
    # so `--dtype auto` gives bf16 on CUDA with FP8 (fp16 without)
    config = StageConfig(name="d", kind="diffusion", model="tiny-image")
    assert quantize.gpu_dtype(dataclasses.replace(config, quantization="fp8")) == torch.bfloat16
    assert quantize.gpu_dtype(config) == torch.float16


def test_a_torch_without_rowwise_fp8_kernels_is_refused_with_torchs_words(monkeypatch):
    assert quantize.fp8_problem(torch.device("cpu")) is None  # this torch runs them

    def missing(*args, **kwargs):
        raise RuntimeError("_scaled_mm_out_cpu: rowwise scaling is not supported\nmore")

    monkeypatch.setattr(torch, "_scaled_mm", missing)
    assert quantize.fp8_problem(torch.device("cpu")) == (
        f"--quantization fp8: torch {torch.__version__}'s rowwise torch._scaled_mm fails here: "
        "_scaled_mm_out_cpu: rowwise scaling is not supported"
    )
    monkeypatch.setattr(torch, "_scaled_mm", lambda a, b, **kw: torch.zeros(4, 16))
    assert quantize.fp8_problem(torch.device("cpu")) == (
        "--quantization fp8: torch._scaled_mm's rowwise FP8 product is wrong here (0.0 dB)"
    )
    with pytest.raises(ConfigError, match="is wrong here"):
        quantize.check_fp8(torch.device("cpu"), torch.float32)
    assert quantize.fp8_problem(torch.device("mps")) == (
        "--quantization fp8 runs on CUDA and on the CPU, not on mps"
    )


def test_torchao_is_described_precisely_and_refuses_nothing(monkeypatch):
    """The server's FP8 path does not use torchao: the log says which torchao is there, whether
    it is the pinned one and whether its C++ kernels loaded for this torch."""
    pin, torch_version = quantize.TORCHAO_PIN, torch.__version__

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", absent)
    assert quantize.torchao_state() == (
        f"torchao not installed (the fp8 extra pins {pin}; the server does not use it)"
    )
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.17.0")
    monkeypatch.setattr(quantize, "_torchao_kernels", lambda: (1, 2))
    assert quantize.torchao_state() == (
        f"torchao 0.17.0 (not the pinned {pin}): 1 of 2 C++ kernel libraries loaded for torch "
        f"{torch_version} (unused by the server's FP8 path)"
    )
    monkeypatch.setattr(importlib.metadata, "version", lambda name: pin)
    monkeypatch.setattr(quantize, "_torchao_kernels", lambda: (0, 2))
    assert quantize.torchao_state().startswith(f"torchao {pin} (the pinned version): 0 of 2")


def test_the_kernel_count_is_torchaos_own_libraries():
    pytest.importorskip("torchao")
    loaded, shipped = quantize._torchao_kernels()
    assert 0 <= loaded <= shipped


def test_the_pinned_torchao_is_the_fp8_extras():
    pyproject = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    extra = pyproject["project"]["optional-dependencies"]["fp8"]
    assert extra == [f"torchao=={quantize.TORCHAO_PIN}"]


def test_a_layer_whose_sides_the_kernels_do_not_take_is_kept():
    assert quantize.keeps("blocks.0.ff", torch.nn.Linear(64, 40), ())  # 40: not a multiple of 16
    assert not quantize.keeps("blocks.0.ff", torch.nn.Linear(64, 48), ())
    assert quantize.keeps("proj_out", torch.nn.Linear(64, 48), ("proj_out",))
    assert not quantize.keeps("blocks.0.proj_out", torch.nn.Linear(64, 48), ("proj_out",))


def test_the_precision_a_stage_reports():
    assert quantize.precision_of("fp8", torch.bfloat16) == "fp8"
    assert quantize.precision_of("none", torch.bfloat16) == "bf16"
    assert quantize.precision_of("none", torch.float32) == "fp32"


DRILL_CLIPS, DRILL_SEED, DRILL_BATCH = 200, 56, 25


def shapes_accuracy(quantization: str, clips: int = DRILL_CLIPS) -> dict[str, float]:
    """The trained tiny-video in bf16 (`quantization` fp8: every linear layer of its
    transformer FP8, none kept) over `clips` seeded held-in clips, as training/train_video.py
    evaluates it (9 frames, 20 steps, guidance 5): the share whose shape moves the asked way,
    and whose middle frame's shape has the asked colour (vllm_omni_like/shapes/checker.py)."""
    import random

    from vllm_omni_like.params import GenerationParams
    from vllm_omni_like.pipelines.catalog import resolve
    from vllm_omni_like.shapes import checker, world
    from vllm_omni_like.stages.base import StageControl, create_stage
    from vllm_omni_like.stages.faults import FaultInjector
    from vllm_omni_like.wire import StageRequest

    rng = random.Random(DRILL_SEED)
    found = [world.sample_clip(rng) for _ in range(clips)]
    config = resolve("tiny-video", dtype="bf16", quantization=quantization)[0].stages[0]
    stage = create_stage(config)
    stage.load("cpu")
    control = StageControl(FaultInjector((), "diffusion"))
    moved = coloured = 0
    for start in range(0, clips, DRILL_BATCH):
        batch = [
            StageRequest(
                f"c{start + i}",
                clip.caption(),
                GenerationParams(
                    seed=DRILL_SEED + start + i,
                    num_inference_steps=20,
                    guidance_scale=5.0,
                    num_frames=9,
                ),
                mode="text2video",
            )
            for i, clip in enumerate(found[start : start + DRILL_BATCH])
        ]
        for clip, out in zip(found[start:], stage.execute(batch, control), strict=False):
            frames = out.video.frames
            moved += checker.motion(frames) == clip.direction
            coloured += checker.read_image(frames[len(frames) // 2])["colour"] == clip.colour
    return {"direction": moved / clips, "shape_colour": coloured / clips}


@pytest.mark.drill
@pytest.mark.timeout(3600)  # two runs of 200 clips of 20 steps in bf16 on a CPU: ~25 minutes
def test_the_trained_tiny_video_draws_as_well_with_every_linear_layer_fp8(monkeypatch):
    """Item 6 of #56: the embedded tiny-video (a Wan DiT, trained) with every linear layer of
    its transformer forced to FP8 still draws what it is asked: the shapes checker's accuracy
    within 1 point of bf16's over 200 seeded prompts, attribute by attribute."""
    from vllm_omni_like.models.wan.adapter import WanAdapter

    full = shapes_accuracy("none")
    monkeypatch.setattr(WanAdapter, "high_precision_layers", lambda self: ())
    fp8 = shapes_accuracy("fp8")
    print(f"tiny-video shapes accuracy over {DRILL_CLIPS} clips: bf16 {full}, fp8 {fp8}")
    assert all(abs(fp8[k] - full[k]) <= 0.01 for k in full), (full, fp8)
