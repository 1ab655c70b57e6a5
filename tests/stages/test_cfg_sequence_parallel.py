"""CFG-parallel x sequence parallelism (2 x N ranks) on the CPU: two gloo groups of N ranks in
real worker processes. Rank 0 runs the loop and leads the conditional branch's group; each
step's unconditional forward goes to rank N, which leads the second group's forward; each
group's all-to-alls stay within it. The same latents as one rank at the same seed, in float32
within 1e-5 (tests/stages/sequence_probe.py writes both sides' latents and the tokens each
rank's blocks took): Wan2.2-TI2V (token counts that 2 does not divide, two lengths stepping in
one running set) and FLUX.1 (no guidance: the second group idles). The deaths: tests/stages/
test_sequence_parallel_deaths.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.models.tiny_mmdit import tiny_flux_path
from tests.models.tiny_wan22 import tiny_wan22_ti2v_path
from tests.stages.sequence_probe import PROBE_ENV
from tests.stages.test_cfg_parallel_loop import rank_threads
from tests.stages.test_sequence_parallel import (
    _config,
    _pixels,
    _request,
    _sequence_parallel,
    _ti2v_requests,
)
from vllm_omni_like.config import StageConfig
from vllm_omni_like.executor import placement
from vllm_omni_like.outputs import StageOutput
from vllm_omni_like.stages.base import StageControl, create_stage
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.wire import RequestResult, StageRequest

pytestmark = pytest.mark.slow
TOLERANCE = 1e-5


def test_config_takes_devices_2n_by_2n():
    both = StageConfig(
        name="d", kind="diffusion", cfg_parallel=True, sequence_parallel=2, devices=tuple(range(8))
    )
    assert (both.replicas, both.workers_per_replica, both.leads) == (2, 4, True)
    assert placement.rank_devices(both, 1) == ("cuda:4", "cuda:5", "cuda:6", "cuda:7")
    cpu = StageConfig(
        name="d", kind="diffusion", cfg_parallel=True, sequence_parallel=2, device="cpu"
    )
    assert cpu.workers_per_replica == 4 and cpu.replicas == 1 and not cpu.decode_overlap


def _reference(model: str, requests: list[StageRequest], where: Path) -> dict[str, StageOutput]:
    """One rank, in this process, each request alone, its branches in two forwards as the two
    groups run them (one forward of both rounds otherwise: a batch of twice the rows), on a
    rank's share of the cores."""
    config = _config(model, device="cpu", batched_cfg=False)
    stage = create_stage(config)
    with pytest.MonkeyPatch.context() as mp, rank_threads(4):
        mp.setenv(PROBE_ENV, str(where))
        stage.load("cpu")
        control = StageControl(FaultInjector((), config.name))
        outs = {r.request_id: stage.execute([r], control)[0] for r in requests}
    stage.close()
    assert all(out.error is None for out in outs.values()), outs
    return outs


def _tokens(where: Path, rank: int) -> list[int]:
    path = where / f"tokens-rank{rank}.txt"
    return [int(t) for t in path.read_text().split()] if path.exists() else []


def check_equal_to_one_rank(model: str, n: int, requests: list[StageRequest], tmp: Path):
    """Every request's latents within 1e-5 of one rank's, its pixels within 1 level; each
    group's ranks took the same forwards, each its share of the tokens; returns the shares of
    the conditional group's and the unconditional one's forwards, and the one rank's tokens."""
    one, split = tmp / "one", tmp / "split"
    one.mkdir()
    split.mkdir()
    msgs = _sequence_parallel(model, n, requests, split, cfg_parallel=True)
    results = {m.output.request_id: m.output for m in msgs if isinstance(m, RequestResult)}
    assert all(out.error is None for out in results.values()), results
    want = _reference(model, requests, one)
    for rid, ref in want.items():
        got, latents = torch.load(split / f"{rid}.pt"), torch.load(one / f"{rid}.pt")
        assert got.shape == latents.shape and (got - latents).abs().max() <= TOLERANCE, rid
        assert np.abs(_pixels(results[rid]) - _pixels(ref)).max() <= 1, rid
    cond, uncond = ([_tokens(split, g * n + r) for r in range(n)] for g in (0, 1))
    assert all(s == cond[0] for s in cond) and all(s == uncond[0] for s in uncond)
    whole = _tokens(one, 0)
    assert sorted(set(cond[0])) == sorted({-(-t // n) for t in whole})
    return cond[0], uncond[0], whole


def test_ti2v_videos_equal_one_rank_on_2_x_2_ranks(tmp_path):
    """4 processes: 75 and 27 tokens (2 divides neither), the two lengths in one running set;
    the second group ran the unconditional forward of each step (as many as the first's)."""
    cond, uncond, whole = check_equal_to_one_rank(
        tiny_wan22_ti2v_path(), 2, _ti2v_requests(), tmp_path
    )
    assert sorted(uncond) == sorted(cond) and len(whole) == 2 * len(cond)


@pytest.mark.drill  # (4 more processes: FLUX.1's split beside an idle second group)
def test_flux_images_equal_one_rank_on_2_x_2_ranks(tmp_path):
    """No guidance (FLUX.1's is its embedding): every forward is the first group's."""
    requests = [
        _request("short", "text2img", seed=1, num_inference_steps=3, width=80, height=48, n=2),
        _request("long", "text2img", seed=2, num_inference_steps=2, width=80, height=112),
    ]
    cond, uncond, _ = check_equal_to_one_rank(tiny_flux_path(), 2, requests, tmp_path)
    assert sorted(set(cond)) == [30, 70] and uncond == []
