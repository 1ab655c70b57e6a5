"""No step waits on the device (#54): a compiled stage's steps on CUDA, rows with and without
guidance, run under `torch.cuda.set_sync_debug_mode("error")`, which raises at any host-device
synchronisation (the CPU guard, tests/models/test_step_cost.py, can only count calls); skipped
where CUDA is absent (CI)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.models.tiny_z_image import tiny_z_image_path
from vllm_omni_like.config import StageConfig
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.diffusion.running_set import OwnLoopSet
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.wire import StageRequest

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    # diffusers' UNet upsampler asks an lru_cache'd version check in bf16: dynamo warns that it
    # traces through the cache (diffusers' code, not ours)
    pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`"),
    # torch says of the mode itself that it is a prototype (an H100 run failed on that warning)
    pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype"),
]
MODELS = {"stable-diffusion": lambda: "tiny-image", "z-image": tiny_z_image_path}


@pytest.fixture(scope="module", params=sorted(MODELS))
def stage(request) -> DiffusionStage:
    config = StageConfig(
        name="diffusion",
        kind="diffusion",
        model=MODELS[request.param](),
        dtype="bf16",
        compile=True,
        max_batch_size=2,
        batch_buckets=(1, 2),
    )
    stage = DiffusionStage(config)
    stage.load("cuda")
    return stage


@pytest.fixture(autouse=True)
def _sync_mode_restored():
    """Whatever a case ends with, the next fixture loads under the default mode (on an H100 a
    first run left it at "error" for the loads after it)."""
    yield
    torch.cuda.set_sync_debug_mode("default")


@contextlib.contextmanager
def _steps_raise_on_sync(stepped: list[int]):
    """Every step of the running set under CUDA's sync debug mode "error" - the forward, the
    schedulers' update and the set's bookkeeping around them (its progress, its timeline
    mark) - the rest as it was. (An H100's step timeline showed the host never more than one
    step ahead of the device: something in a step waits for the step before.)"""
    step = OwnLoopSet.step

    def strict(self, control, only=None):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return step(self, control, only)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            stepped.append(len(self.set.rows))

    OwnLoopSet.step = strict
    try:
        yield
    finally:
        OwnLoopSet.step = step


def test_a_compiled_step_never_waits_on_the_device(stage):
    cfg_above = stage.runtime.adapter.cfg_above
    for guidance in (cfg_above, cfg_above + 3.0):  # without guidance and with it
        params = GenerationParams(seed=1, num_inference_steps=3, guidance_scale=guidance)
        batch = [StageRequest(f"r{i}", "a red circle", params) for i in range(2)]
        stepped: list[int] = []
        with _steps_raise_on_sync(stepped):
            outs = stage.execute(batch, StageControl(FaultInjector((), "diffusion")))
        assert [o.error for o in outs] == [None, None]
        assert stepped[:3] == [2, 2, 2]  # (a last call finds no row left to step)
