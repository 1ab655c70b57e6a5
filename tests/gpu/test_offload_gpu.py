"""`--offload idle-expert` on a real device (#56 item 5): the idle expert's weights are in pinned
host memory and the resident one's on the device, the device holds one expert's weights, the
copies run on the transfer stream beside the compute stream's work, and the tiny two-expert
Wan's videos equal those without the offload (rows on both sides of the switch in one set);
skipped where CUDA is absent (CI)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.models.tiny_wan22 import tiny_wan22_experts_path
from tests.stages.diffusion.offload_fakes import TwoExperts
from tests.stages.diffusion.test_running_set import _Harness
from vllm_omni_like.config import StageConfig
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.diffusion.expert_policy import HIGH, LOW, SwapPolicy
from vllm_omni_like.stages.diffusion.offload import CudaTransfer, ExpertOffload
from vllm_omni_like.stages.diffusion.quantize import model_bytes
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.wire import StageRequest

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
OPTIONS = {"default_size": 64}


def _stage(offload: str) -> DiffusionStage:
    config = StageConfig(
        name="diffusion",
        kind="diffusion",
        model=tiny_wan22_experts_path(),
        dtype="fp32",
        offload=offload,
        shape_groups=1,  # (the offload's policy runs one lane: speed_settings.py)
        options=OPTIONS,
    )
    stage = DiffusionStage(config)
    stage.load("cuda")
    return stage


def _request(rid: str, seed: int, steps: int) -> StageRequest:
    params = GenerationParams(seed=seed, num_inference_steps=steps, num_frames=5)
    return StageRequest(rid, "a red circle", params, mode="text2video")


def _mixed(stage: DiffusionStage) -> dict[str, np.ndarray]:
    """a steps twice alone, then b and c join on the other side of the switch."""
    h = _Harness(stage)
    h.add(1, _request("a", 3, 6))
    h.steps(2)
    h.add(2, _request("b", 4, 3), _request("c", 5, 4))
    h.steps(64)
    assert not h.rows.running
    out = {}
    for rid in "abc":
        assert h.outputs[rid].error is None, h.outputs[rid].error
        out[rid] = h.outputs[rid].video.frames.astype(np.int16)
    return out


def test_one_expert_on_the_device_the_other_pinned_and_the_same_videos():
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    plain = _stage("none")
    loaded_plain = torch.cuda.memory_allocated() - base
    want = _mixed(plain)
    expert_bytes = model_bytes(plain.runtime.adapter.experts()[1].model)
    plain.close()
    del plain
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    stage = _stage("idle-expert")
    loaded = torch.cuda.memory_allocated() - base
    # the device holds one expert's weights fewer than without the offload
    assert abs(loaded_plain - loaded - expert_bytes) <= expert_bytes // 4
    offload = stage.runtime.denoise.offload
    assert offload is not None and offload.resident == HIGH
    high, low = (e.model for e in stage.runtime.adapter.experts())
    assert all(p.is_cuda for p in high.parameters())
    assert all(p.device.type == "cpu" and p.is_pinned() for p in low.parameters())
    assert offload.report().device_bytes == model_bytes(high)
    got = _mixed(stage)
    for rid, video in want.items():
        assert np.abs(got[rid] - video).max() <= 1, rid
    assert offload.swaps >= 2 and offload.report().last_swap_s is not None
    idle = (high, low)[1 - offload.resident]
    assert all(p.device.type == "cpu" and p.is_pinned() for p in idle.parameters())
    stage.close()


class _Stack(torch.nn.Module):
    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Linear(width, width, bias=False) for _ in range(blocks)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_the_copies_run_on_the_transfer_stream_beside_the_compute_stream():
    """A prefetch enqueued before a compute stream's matmuls: the copy engine's interval and the
    compute's overlap (events on both streams), the host never waits, and a device holds one
    expert's weights plus the prefetched units."""
    device = torch.device("cuda")
    width = 4096
    models = [_Stack(8, width).half().to(device) for _ in range(2)]
    transfer = CudaTransfer(device)
    offload = ExpertOffload(TwoExperts(list(models), 875.0), transfer, SwapPolicy())  # type: ignore[arg-type]  # (an adapter's two methods)
    torch.cuda.empty_cache()
    assert all(p.device.type == "cpu" and p.is_pinned() for p in models[1].parameters())
    compute = torch.cuda.current_stream()
    assert transfer.stream != compute
    x = torch.randn(8192, 8192, device=device, dtype=torch.half)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    torch.cuda.synchronize()
    marks[0].record(compute)
    offload.prefetch(LOW)  # (the head and the first block)
    copy_end = offload.staged[LOW][-1][2]
    marks[1].record(compute)
    for _ in range(20):
        x = x @ x / 8192
    marks[2].record(compute)
    offload.swap_to(LOW)  # the rest, after the compute (its memory may be the old expert's)
    marks[3].record(compute)
    torch.cuda.synchronize()
    start = marks[0]
    copy_done = start.elapsed_time(copy_end)
    compute_span = (start.elapsed_time(marks[1]), start.elapsed_time(marks[2]))
    assert copy_done < compute_span[1], "the prefetch waited for the compute stream"
    out = models[1](torch.randn(4, width, device=device, dtype=torch.half))
    assert out.isfinite().all()
    assert offload.report().device_bytes == sum(p.numel() * 2 for p in models[1].parameters())
    assert all(p.device.type == "cpu" and p.is_pinned() for p in models[0].parameters())
