"""CFG-parallel x sequence parallelism (2 x N ranks) on the CPU: two gloo groups of N ranks in
real worker processes. Rank 0 runs the loop and leads the conditional branch's group; each
step's unconditional forward goes to rank N, which leads the second group's forward; each
group's all-to-alls stay within it. The same latents as one rank at the same seed, in float32
within 1e-5 (tests/stages/sequence_probe.py writes both sides' latents and the tokens each
rank's blocks took): Wan2.2-TI2V (token counts that 2 does not divide, two lengths stepping in
one running set) and FLUX.1 (no guidance: the second group idles); the families split since:
Qwen-Image (true CFG, its texts masked in their bucket), SD3.5 (MMDiT-X) and Z-Image (guidance
above 0, a branch's unified sequence as long as its own caption). The deaths: tests/stages/
test_sequence_parallel_deaths.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.models.test_family_contract import EDIT_IMAGE
from tests.models.tiny_mmdit import tiny_flux_path, tiny_sd3_path
from tests.models.tiny_qwen import tiny_qwen_image_edit_path, tiny_qwen_image_path
from tests.models.tiny_wan22 import tiny_wan22_ti2v_path
from tests.models.tiny_z_image import tiny_z_image_path
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
from vllm_omni_like.params import GenerationParams
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
    group's ranks took the same forwards, each its share of the tokens (the two groups' shares
    together: those of one rank's forwards, whose branches may differ in length - Z-Image's
    captions); returns the shares of the conditional group's and the unconditional one's
    forwards, and the one rank's tokens."""
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
    assert sorted(set(cond[0]) | set(uncond[0])) == sorted({-(-t // n) for t in whole})
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


def _text2img(rid: str, prompt: str, seed: int, steps: int, height: int, **params) -> StageRequest:
    params = {"width": 80, "height": height, "seed": seed, "num_inference_steps": steps, **params}
    return StageRequest(rid, prompt, GenerationParams(**params), mode="text2img")


@pytest.mark.drill  # (4 processes, Qwen2.5-VL's tiny text encoder on each group's leader)
@pytest.mark.timeout(600)  # (four ranks and a reference on a loaded 2-core machine)
def test_qwen_image_true_cfg_equals_one_rank_on_2_x_2_ranks(tmp_path):
    """True CFG (rescaled per token to the conditional norm on rank 0, from the second
    group's branch): 60 and 140 image tokens (48x80, 112x80), each branch's text masked in its
    bucket; every forward split in two in both groups."""
    requests = [
        _text2img("short", "a red circle", 1, 3, 48, guidance_scale=4.0),
        _text2img("long", "a big blue square beside a small green triangle", 2, 2, 112),
    ]
    cond, uncond, whole = check_equal_to_one_rank(tiny_qwen_image_path(), 2, requests, tmp_path)
    assert sorted(set(whole)) == [60, 140] and sorted(uncond) == sorted(cond)


@pytest.mark.drill  # (4 processes and a reference)
@pytest.mark.timeout(600)
def test_sd35_images_equal_one_rank_on_2_x_2_ranks(tmp_path):
    """SD3.5-medium's shape (MMDiT-X: a second attention over the image alone, split too):
    CFG's branches a group each, two images of one request beside another request."""
    requests = [
        _text2img("short", "a red circle", 1, 3, 48, guidance_scale=4.0),
        _text2img("long", "a blue square", 2, 2, 112, guidance_scale=6.0, n=2),
    ]
    cond, uncond, whole = check_equal_to_one_rank(tiny_sd3_path(True), 2, requests, tmp_path)
    assert sorted(set(whole)) == [60, 140] and sorted(uncond) == sorted(cond)


@pytest.mark.drill  # (4 processes and a reference)
@pytest.mark.timeout(600)
def test_z_image_guided_equals_one_rank_on_2_x_2_ranks(tmp_path):
    """Guidance above 0 (Turbo's default is 0): the negative prompt's caption (about 90
    tokens, the 128 bucket) is longer than the prompt's (32), so the two groups split
    sequences of their own lengths (64 image tokens, then the caption: 96 and 192); a row
    without guidance (Turbo's 0) runs on the first group alone (100 image tokens padded to 128,
    then 32)."""
    negative = "a red circle and a blue square " * 12
    requests = [
        _text2img("guided", "a red circle", 1, 3, 48, guidance_scale=0.5, negative_prompt=negative),
        _text2img("plain", "a blue square", 2, 2, 80),
    ]
    cond, uncond, whole = check_equal_to_one_rank(tiny_z_image_path(), 2, requests, tmp_path)
    assert sorted(set(whole)) == [96, 160, 192]
    assert sorted(set(cond)) == [48, 80] and sorted(set(uncond)) == [96]
    assert len(uncond) == 3 and len(cond) == 3 + 2


@pytest.mark.drill  # (4 processes, Qwen2.5-VL reading the upload with each text)
@pytest.mark.timeout(600)
def test_qwen_image_edit_equals_one_rank_on_2_x_2_ranks(tmp_path):
    """An instruction edit: each branch's text read with the upload, the upload's latents'
    tokens after the noise's in the one sequence each group splits (the second group given
    them with its branch), the prediction cut to the noise's."""
    params = GenerationParams(seed=3, num_inference_steps=2, guidance_scale=4.0)
    requests = [StageRequest("e", "make it red", params, mode="edit", images=[EDIT_IMAGE])]
    cond, uncond, _ = check_equal_to_one_rank(tiny_qwen_image_edit_path(), 2, requests, tmp_path)
    assert sorted(uncond) == sorted(cond) and len(cond) == 2
