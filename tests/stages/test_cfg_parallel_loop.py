"""CFG-parallel on our own loop (parallel/cfg_parallel.py's `LoopBranches`, stages/diffusion/
step.py) on the CPU: two gloo ranks per replica in real worker processes. Rank 0 runs the loop
and the running set; each step's unconditional forward of the rows with guidance runs on rank
1. The same latents as one rank at the same seed, in float32 within 1e-5 (tests/stages/
cfg_probe.py writes both sides' latents and the rows of each rank's forwards): SD1.5's UNet
(tiny-image), SD3's MMDiT, Wan2.1 (tiny-video), Wan2.2-A14B's two experts, Qwen-Image's true
CFG with its rescale; rows of different guidance (one without: rank 0 alone) and a group that
joins the busy set at a later step."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.models.tiny_mmdit import tiny_sd3_path
from tests.models.tiny_qwen import tiny_qwen_image_path
from tests.models.tiny_wan22 import tiny_wan22_experts_path
from tests.stages.cfg_probe import PROBE_ENV
from tests.stages.replica_ranks import probed_replica
from tests.stages.test_sequence_parallel import _pixels
from vllm_omni_like.config import StageConfig
from vllm_omni_like.models.limits import describe_stage
from vllm_omni_like.outputs import StageOutput
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.pipelines.catalog import resolve
from vllm_omni_like.stages.base import StageControl, create_stage
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.wire import ExecuteBatch, Progress, RequestResult, StageRequest

pytestmark = pytest.mark.slow
PROBE = "tests.stages.cfg_probe:CfgProbeStage"
TOLERANCE = 1e-5
KW = {"device": "cpu", "stall_timeout": 5.0, "cold_step_timeout": 60.0}


def _request(rid: str, mode: str, **params) -> StageRequest:
    return StageRequest(rid, "a red circle", GenerationParams(**params), mode=mode)


def _config(model: str, **kw) -> StageConfig:
    """The model's diffusion stage as the server resolves it, run by the probe stage."""
    return dataclasses.replace(resolve(model, **kw)[0].stages[-1], kind=PROBE)


def _reference(
    model: str, groups: list[list[StageRequest]], joined: dict[int, int], where: Path, **both
) -> dict[str, StageOutput]:
    """One rank, in this process: the same groups through its running set, each later group
    joining after as many steps of the first as it did on the two ranks (`joined`), the
    branches in two forwards as the ranks run them (a forward of both rounds otherwise: one
    batch of twice the rows; tests/stages/diffusion/test_step.py bounds that), on a rank's
    share of the cores; the final latents in `where`. `both`: the stage's settings on both
    sides (LoRA adapters). Returns each request's output."""
    config = _config(model, device="cpu", batched_cfg=False, **both)
    stage = create_stage(config)
    with pytest.MonkeyPatch.context() as mp, rank_threads(2):
        mp.setenv(PROBE_ENV, str(where))
        stage.load("cpu")
        control = StageControl(FaultInjector((), config.name))
        rowset = stage.stepper(groups[0][0].mode)
        assert rowset is not None
        rowset.join(groups[0], control)
        pending, outs = dict(enumerate(groups[1:], 2)), []
        for step in range(1, 1000):  # (bounded: every row ends within its steps)
            for batch_id in [b for b in pending if joined[b] == step - 1]:
                rowset.join(pending.pop(batch_id), control)
            if rowset.set.empty:
                break
            rowset.step(control)
            # (the probe keeps each row's latents as it leaves)
            if (part := rowset.leave(control)) is not None:
                outs += part.finish(part.requests)
    stage.close()
    assert not pending and rowset.set.empty
    return {out.request_id: out for out in outs}


@contextlib.contextmanager
def rank_threads(ranks: int) -> Iterator[None]:
    """The CPU threads one of a replica's `ranks` ranks computes with (each takes its share of
    the cores, parallel/rank_link.py): a matmul's rounding may depend on them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, threads // ranks))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def cfg_parallel(model: str, groups: list[list[StageRequest]], join_at: int, where: Path, **kw):
    """One CFG-parallel replica; the first group sent at once, the others once it reported step
    `join_at` (they join its running set); the messages it sent, once every group is done and
    the ranks are gone."""
    config = _config(model, cfg_parallel=True, **KW, **kw)
    assert config.workers_per_replica == 2
    with probed_replica(config, PROBE_ENV, where) as replica:
        replica.ex.execute(ExecuteBatch(1, groups[0]))
        sent = [groups[0]]

        def join() -> None:
            msgs = replica.msgs
            if len(sent) == 1 and any(isinstance(m, Progress) and m.step >= join_at for m in msgs):
                for i, group in enumerate(groups[1:]):
                    replica.ex.execute(ExecuteBatch(i + 2, group))
                sent.extend(groups[1:])

        return replica.until_done(len(groups), join)


def _rows(where: Path, rank: int) -> list[int]:
    return [int(n) for n in (where / f"rows-rank{rank}.txt").read_text().split()]


def check_equal_to_one_rank(
    model: str,
    groups: list[list[StageRequest]],
    tmp: Path,
    join_at: int = 2,
    both: dict | None = None,
    **kw,
) -> list[object]:
    """Every request's latents within 1e-5 of one rank's, its pixels within 1 level (`both`: the
    stage's settings on both sides); the rows each rank's forwards ran: rank 1 the unconditional
    ones, rank 0 the others (together the one rank's)."""
    one, split = tmp / "one", tmp / "split"
    one.mkdir()
    split.mkdir()
    msgs = cfg_parallel(model, groups, join_at, split, **(both or {}), **kw)
    results = {m.output.request_id: m.output for m in msgs if isinstance(m, RequestResult)}
    assert all(out.error is None for out in results.values()), results
    requests = [r for group in groups for r in group]
    ref = _reference(model, groups, _joined_after(msgs, len(groups)), one, **(both or {}))
    for r in requests:
        rid = r.request_id
        got, want = torch.load(split / f"{rid}.pt"), torch.load(one / f"{rid}.pt")
        assert got.shape == want.shape and (got - want).abs().max() <= TOLERANCE, rid
        assert np.abs(_pixels(results[rid]) - _pixels(ref[rid])).max() <= 1, rid
    assert sum(_rows(split, 0)) + sum(_rows(split, 1)) == sum(_rows(one, 0))
    return msgs


def _joined_after(msgs: list[object], groups: int) -> dict[int, int]:
    """The steps of the first group each later group joined after (on the two ranks), as the
    first Progress naming it says; at least 1: it joined a busy set."""
    after = {}
    for batch_id in range(2, groups + 1):
        first = next(m for m in msgs if isinstance(m, Progress) and batch_id in m.joined)
        assert first.batch_id == 1 and first.progress is not None  # (it stepped with group 1)
        after[batch_id] = first.step - 1
        assert after[batch_id] >= 1, after
    return after


def test_images_equal_one_rank_with_a_join_and_rows_of_other_guidance(tmp_path):
    """tiny-image (SD1.5's UNet): a request of 6 steps at 7.5; at its second step a group of
    two joins (3.0, and 1.0: no guidance, its rows on rank 0 alone)."""
    groups = [
        [_request("a", "text2img", seed=1, num_inference_steps=6, guidance_scale=7.5)],
        [
            _request("b", "text2img", seed=2, num_inference_steps=3, guidance_scale=3.0),
            _request("c", "text2img", seed=3, num_inference_steps=3, guidance_scale=1.0),
        ],
    ]
    check_equal_to_one_rank("tiny-image", groups, tmp_path)
    assert sum(_rows(tmp_path / "split", 1)) == 6 + 3  # a's and b's unconditional rows
    served = resolve("tiny-image", cfg_parallel=True, **KW)[0].stages[-1]
    assert describe_stage(served)["loops"] == {  # (/health's `loops`)
        "text2img": "own",
        "edit": "own",
        "inpaint": "own",
    }


@pytest.mark.drill  # (the suite's time: two more ranks and a reference)
def test_sd3_images_equal_one_rank(tmp_path):
    groups = [
        [_request("a", "text2img", seed=1, num_inference_steps=4, guidance_scale=4.0, n=2)],
        [_request("b", "text2img", seed=2, num_inference_steps=3, guidance_scale=6.0)],
    ]
    check_equal_to_one_rank(tiny_sd3_path(), groups, tmp_path)


@pytest.mark.drill
@pytest.mark.timeout(400)  # (Qwen2.5-VL's tiny text encoder on two ranks and a reference)
def test_qwen_image_true_cfg_equals_one_rank(tmp_path):
    """True CFG rescaled per token to the conditional norm, on rank 0, from rank 1's branch."""
    groups = [
        [_request("a", "text2img", seed=1, num_inference_steps=4, guidance_scale=4.0)],
        [_request("b", "text2img", seed=2, num_inference_steps=3, guidance_scale=2.5)],
    ]
    check_equal_to_one_rank(tiny_qwen_image_path(), groups, tmp_path)


@pytest.mark.drill
def test_wan21_videos_equal_one_rank(tmp_path):
    groups = [
        [_request("a", "text2video", seed=3, num_inference_steps=4, num_frames=5)],
        [
            _request(
                "b", "text2video", seed=4, num_inference_steps=3, num_frames=5, guidance_scale=3.0
            )
        ],
    ]
    check_equal_to_one_rank("tiny-video", groups, tmp_path)


@pytest.mark.drill
def test_wan22_two_experts_equal_one_rank(tmp_path):
    """A14B's shape: each row's expert by its timestep on both ranks, the low-noise expert's
    own scale (`guidance_scale_2`) from the step it takes over."""
    size = {"num_frames": 5, "width": 64, "height": 64}
    groups = [
        [_request("a", "text2video", seed=6, num_inference_steps=4, guidance_scale_2=2.0, **size)],
        [_request("b", "text2video", seed=7, num_inference_steps=4, **size)],
    ]
    check_equal_to_one_rank(tiny_wan22_experts_path(), groups, tmp_path, join_at=1)
