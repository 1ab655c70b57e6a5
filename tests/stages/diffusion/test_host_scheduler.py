"""HostUniPC: diffusers' UniPC steps with the coefficients computed on the host."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import DDIMScheduler, UniPCMultistepScheduler

import vllm_omni_like
from vllm_omni_like.stages.diffusion.host_scheduler import HostUniPC, host_scheduler

WAN = Path(vllm_omni_like.__file__).parent / "assets/archs/wan2.1-t2v-1.3b/scheduler"
CONFIG = json.loads((WAN / "scheduler_config.json").read_text())


def trajectory(cls: type, extra: dict, device: str = "cpu", dtype=torch.float32) -> torch.Tensor:
    """20 steps on a fixed sample and model outputs (a function of the sample)."""
    scheduler = cls.from_config({**CONFIG, **extra})
    scheduler.set_timesteps(20, device=device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 3, 8, 8, generator=g).to(device)
    for t in scheduler.timesteps:
        noise = torch.randn(x.shape, generator=g).to(device)
        out = (0.5 * noise + 0.1 * x).to(dtype)  # a bf16 model's output with a float32 sample
        x = scheduler.step(out, t, x, return_dict=False)[0]
    return x


@pytest.mark.parametrize(
    "extra",
    [
        {},  # Wan's: flow prediction, bh2, order 2
        {"solver_order": 3},  # the predictor's linear solve too
        {"prediction_type": "epsilon", "use_flow_sigmas": False},
        {
            "prediction_type": "epsilon",
            "use_flow_sigmas": False,
            "solver_type": "bh1",
            "final_sigmas_type": "sigma_min",
        },  # (bh1 and UniPC-on-noise need a last sigma > 0)
        {
            "prediction_type": "v_prediction",
            "use_flow_sigmas": False,
            "predict_x0": False,
            "final_sigmas_type": "sigma_min",
        },
        {"disable_corrector": [0, 1, 2]},
    ],
)
def test_the_same_steps_as_diffusers(extra):
    ours, theirs = trajectory(HostUniPC, extra), trajectory(UniPCMultistepScheduler, extra)
    assert torch.isfinite(theirs).all()
    assert ours.dtype == theirs.dtype == torch.float32
    scale = theirs.abs().max().item()
    assert (ours - theirs).abs().max().item() <= 2e-6 * max(1.0, scale)
    assert not torch.equal(
        theirs, trajectory(UniPCMultistepScheduler, {**extra, "solver_order": 1})
    )


def test_bf16_model_outputs_as_diffusers():
    ours = trajectory(HostUniPC, {}, dtype=torch.bfloat16)
    theirs = trajectory(UniPCMultistepScheduler, {}, dtype=torch.bfloat16)
    assert ours.dtype == torch.float32
    assert (ours - theirs).abs().max().item() <= 1e-5


def test_installed_for_unipc_only():
    class Pipe:
        scheduler = UniPCMultistepScheduler.from_config(CONFIG)

    pipe = Pipe()
    assert host_scheduler(pipe)
    assert type(pipe.scheduler) is HostUniPC
    ours, theirs = dict(pipe.scheduler.config), dict(Pipe.scheduler.config)
    assert ours.pop("_class_name") == "HostUniPC" and theirs.pop("_class_name")
    assert ours == theirs
    assert not host_scheduler(pipe)  # already ours

    class Other:
        scheduler = DDIMScheduler()

    other = Other()
    assert not host_scheduler(other) and type(other.scheduler) is DDIMScheduler


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype")
def test_steps_never_wait_on_the_device():
    """Every step after the first (which finds its index in the device's timesteps) runs with
    CUDA's sync debugging set to raise, and matches diffusers' steps on the GPU."""
    scheduler = HostUniPC.from_config(CONFIG)
    scheduler.set_timesteps(20, device="cuda")
    x = torch.randn(1, 16, 3, 30, 52, device="cuda")
    noise = torch.randn_like(x)
    steps = 0
    for i, t in enumerate(scheduler.timesteps):
        torch.cuda.set_sync_debug_mode("error" if i else "default")
        try:
            x = scheduler.step(0.5 * noise + 0.1 * x, t, x, return_dict=False)[0]
            steps += 1
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert steps == 20
    reference = trajectory(UniPCMultistepScheduler, {}, device="cuda").cpu()
    assert (trajectory(HostUniPC, {}, device="cuda").cpu() - reference).abs().max() <= 1e-5
