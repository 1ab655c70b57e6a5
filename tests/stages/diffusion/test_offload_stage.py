"""`--offload idle-expert` on the tiny two-expert Wan (the CPU: its swap through the fake transfer
of offload_fakes.py, installed after the load, as the load installs CUDA's): a request makes the
video it makes without the offload; rows on both sides of the boundary share a running set, one
expert's rows stepping at a time, and each makes its own video; an abort after a prefetch
leaves nothing held; FP8 weights and LoRA adapters run through swaps."""

from __future__ import annotations

import numpy as np
import pytest

from tests.models.tiny_wan22 import experts_config, experts_stage, video_frames, video_request
from tests.stages.diffusion.offload_fakes import FakeTransfer
from tests.stages.diffusion.test_running_set import _Harness
from vllm_omni_like.errors import ConfigError
from vllm_omni_like.params import LoraRef
from vllm_omni_like.stages.diffusion.expert_policy import HIGH, SwapPolicy
from vllm_omni_like.stages.diffusion.offload import ExpertOffload
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.wire import StageRequest

pytestmark = pytest.mark.slow


def _offload(stage: DiffusionStage, transfer: FakeTransfer) -> ExpertOffload:
    """The offload the load installs on CUDA, over the fake transfer."""
    offload = ExpertOffload(stage.runtime.adapter, transfer, SwapPolicy())
    stage.runtime.denoise.offload = offload
    return offload


def _steps_of(offload: ExpertOffload) -> list[tuple[int, list[int]]]:
    """Each committed step's expert and its rows' needs (the offload's own record, kept)."""
    log: list[tuple[int, list[int]]] = []
    stepped = offload.stepped

    def record(before: int | None, chosen: int, needs: list[int]) -> None:
        log.append((chosen, list(needs)))
        stepped(before, chosen, needs)

    offload.stepped = record  # type: ignore[method-assign]  # (a test's record of the steps)
    return log


def _alone(stage: DiffusionStage, request: StageRequest) -> np.ndarray:
    h = _Harness(stage)
    h.add(1, request)
    h.steps(64)
    return video_frames(h.outputs, request.request_id)


def test_rows_on_both_sides_of_the_switch_make_their_own_videos():
    """a steps once alone, then b and c join at their first (high-noise) steps while a is past
    the boundary: the set steps one expert's rows at a time (the others wait, a swap between),
    and each request's video is its video without the offload, alone."""
    stage = experts_stage()
    try:
        a, b = video_request("a", 3, 4), video_request("b", 4, 3)
        c = video_request("c", 5, 4, guidance_scale_2=1.5)
        want = {r.request_id: _alone(stage, r) for r in (a, b, c)}
        transfer = FakeTransfer()
        offload = _offload(stage, transfer)
        log = _steps_of(offload)
        h = _Harness(stage)
        h.add(1, a)
        h.steps(1)
        h.add(2, b, c)
        h.steps(64)  # (a bound: 4 + 3 + 4 set steps at most, one expert's rows each)
        assert not h.rows.running and len(h.stepped) <= 4 + 3 + 4
        for rid, video in want.items():
            assert np.abs(video_frames(h.outputs, rid) - video).max() <= 1, rid
        # a's high-noise step; b's and c's (a waits one step); then the low-noise one's
        high = [(0, [0]), (0, [1, 0, 0])]
        assert log == [*high, (1, [1, 1, 1]), (1, [1, 1, 1]), (1, [1, 1])], log
        assert offload.swaps == 1 and offload.resident == 1  # (one swap: at a's switch)
        assert transfer.held(offload) == sum(len(u.slots) for u in offload.units[1 - HIGH])
    finally:
        stage.close()


@pytest.mark.drill
def test_an_abort_after_a_prefetch_leaves_nothing_held():
    stage = experts_stage()
    try:
        a = video_request("a", 3, 6)
        want = _alone(stage, a)
        transfer = FakeTransfer()
        offload = _offload(stage, transfer)
        h = _Harness(stage)
        h.add(1, a)
        h.steps(2)  # its second step: the next one swaps, its first blocks are prefetched
        assert 1 in offload.staged and transfer.held(offload) > 0
        h.control.abort(["a"])
        h.steps(1)
        assert not h.rows.running and "a" not in h.outputs
        assert offload.staged == {} and transfer.held(offload) == 0
        assert offload.resident == HIGH and offload.swaps == 0
        assert np.array_equal(_alone(stage, video_request("a2", 3, 6)), want)  # it serves on
    finally:
        stage.close()


@pytest.mark.drill
def test_fp8_weights_move_as_they_are():
    stage = experts_stage(quantization="fp8")
    try:
        a = video_request("a", 3, 4)
        want = _alone(stage, a)
        offload = _offload(stage, FakeTransfer())
        assert np.array_equal(_alone(stage, a), want) and offload.swaps == 1
        moved = {s.name for u in offload.units[1] for s in u.slots}
        assert {"qweight", "weight_scale"} <= moved  # (the FP8 buffers are offloaded too)
    finally:
        stage.close()


@pytest.mark.drill
def test_lora_adapters_run_through_a_swap(tmp_path):
    """The pool's slots stay on the device (a join writes them): an adapter's rows across the
    switch make what they make without the offload."""
    from tests.stages.diffusion.lora_helpers import expert_files

    files = expert_files(tmp_path)
    stage = experts_stage(dtype="float32", loras=(f"each={files['each']}",), max_lora_rank=4)
    try:
        a = video_request("a", 3, 4, loras=(LoraRef("each", 0.8),))
        want = _alone(stage, a)
        offload = _offload(stage, FakeTransfer())
        assert np.array_equal(_alone(stage, a), want) and offload.swaps == 1
        moved = {s.name for u in offload.units[1] for s in u.slots}
        assert not moved & {"lora_a", "lora_b"}
    finally:
        stage.close()


def test_the_load_refuses_the_offload_on_the_cpu():
    config = experts_config(options={}, offload="idle-expert", shape_groups=1)
    with pytest.raises(ConfigError, match="--offload idle-expert needs a CUDA device: on cpu"):
        DiffusionStage(config).load("cpu")
