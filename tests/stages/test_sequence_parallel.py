"""Sequence parallelism (parallel/sequence_parallel.py) on the CPU: N gloo ranks per replica in
real worker processes, every rank holding the whole transformer and its share of the tokens.
The same latents as one rank at the same seed, in float32 within 1e-5 (tests/stages/
sequence_probe.py writes both sides' latents and the tokens each rank's blocks took): FLUX.1
and the Wan family (Wan2.1, Wan2.2-TI2V's timestep per token, A14B's two experts), token counts
that divide by neither 2 nor 4, groups of two lengths stepping in one running set."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.models.test_family_contract import EDIT_IMAGE
from tests.models.tiny_mmdit import tiny_flux_path
from tests.models.tiny_wan22 import tiny_wan22_experts_path, tiny_wan22_ti2v_path
from tests.stages.replica_ranks import lora_videos, probed_replica
from tests.stages.sequence_probe import PROBE_ENV
from vllm_omni_like.config import StageConfig
from vllm_omni_like.errors import ConfigError
from vllm_omni_like.executor import placement
from vllm_omni_like.outputs import StageOutput
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.pipelines.catalog import resolve
from vllm_omni_like.stages.base import StageControl, create_stage
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.wire import BatchDone, ExecuteBatch, Progress, RequestResult, StageRequest

pytestmark = pytest.mark.slow
PROBE = "tests.stages.sequence_probe:SequenceProbeStage"
TOLERANCE = 1e-5
KW = {"device": "cpu", "stall_timeout": 5.0, "cold_step_timeout": 60.0}


def test_config_takes_devices_n_by_n_and_refuses_what_does_not_fit():
    four = StageConfig(name="d", kind="diffusion", sequence_parallel=4, devices=tuple(range(8)))
    assert (four.replicas, four.workers_per_replica, four.leads) == (2, 4, True)
    assert placement.rank_devices(four, 1) == ("cuda:4", "cuda:5", "cuda:6", "cuda:7")
    assert placement.replica_label(four, 0) == "cuda:0,cuda:1,cuda:2,cuda:3"
    cpu = StageConfig(name="d", kind="diffusion", sequence_parallel=2, device="cpu")
    assert placement.rank_devices(cpu, 0) == ("cpu", "cpu") and cpu.replicas == 1
    one = StageConfig(name="d", kind="diffusion")
    assert (one.sequence_parallel, one.workers_per_replica, one.leads) == (1, 1, False)
    for bad, why in (
        ({"sequence_parallel": 0}, "must be an integer >= 1"),
        ({"sequence_parallel": True}, "must be an integer >= 1"),
        ({"sequence_parallel": 2, "devices": (0, 1, 2)}, "takes devices 2 by 2, not 3"),
        ({"sequence_parallel": 2, "devices": (1, 1)}, "need 2 GPUs"),
        ({"sequence_parallel": 2, "devices": (0, "cpu")}, "all GPUs or all CPU"),
        ({"sequence_parallel": 2}, "need 2 devices: name them with --devices"),
        ({"sequence_parallel": 2, "device": "cpu", "kind": "llm"}, "diffusion stages only"),
        ({"sequence_parallel": 2, "device": "cpu", "workers_per_replica": 3}, "2 workers"),
        (
            {"sequence_parallel": 2, "cfg_parallel": True, "devices": tuple(range(6))},
            "4 by 4, not 6",
        ),
    ):
        with pytest.raises(ConfigError, match=why):
            StageConfig(**{"name": "d", "kind": "diffusion", **bad})
    # a whole pipeline's flag leaves its LLM stage alone
    llm, diffusion = resolve("tiny-omni", sequence_parallel=2, device="cpu")[0].stages
    assert (llm.sequence_parallel, diffusion.sequence_parallel) == (1, 2)


def _request(rid: str, mode: str, **params) -> StageRequest:
    return StageRequest(rid, "a red circle", GenerationParams(**params), mode=mode)


def _config(model: str, **kw) -> StageConfig:
    """The model's diffusion stage as the server resolves it, run by the probe stage."""
    return dataclasses.replace(resolve(model, **kw)[0].stages[-1], kind=PROBE)


def _reference(
    model: str, requests: list[StageRequest], where: Path, together: bool = False, **kw
) -> dict[str, StageOutput]:
    """One rank, in this process, each request alone (`together`: all in one batch): its
    outputs (its final latents in `where`)."""
    config = _config(model, device="cpu", **kw)
    stage = create_stage(config)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(PROBE_ENV, str(where))
        stage.load("cpu")
        control = StageControl(FaultInjector((), config.name))
        if together:
            outs = {out.request_id: out for out in stage.execute(requests, control)}
        else:
            outs = {r.request_id: stage.execute([r], control)[0] for r in requests}
    stage.close()
    assert all(out.error is None for out in outs.values()), outs
    return outs


def _sequence_parallel(
    model: str, n: int, requests: list[StageRequest], where: Path, together=False, **kw
):
    """One replica of `n` ranks, each request its own group sent at once (they step in one
    running set; `together`: one group of all); the messages it sent, once every group is done
    and the ranks are gone."""
    config = _config(model, sequence_parallel=n, **KW, **kw)
    groups = [requests] if together else [[r] for r in requests]
    with probed_replica(config, PROBE_ENV, where) as replica:
        for i, group in enumerate(groups):
            replica.ex.execute(ExecuteBatch(i + 1, group))
        return replica.until_done(len(groups))


def _pixels(out: StageOutput) -> np.ndarray:
    media = [out.video.frames] if out.video is not None else [i.pixels for i in out.images]
    return np.stack(media).astype(int)


def check_equal_to_one_rank(
    model: str, n: int, requests: list[StageRequest], tmp: Path, both=None, **kw
):
    """Every request's latents within 1e-5 of one rank's, its pixels within 1 level (a float
    difference that small may round a level apart); every rank's blocks took the same
    forwards, each its share of the tokens the one rank's took whole (padding included).
    `both`: the stage's settings on both sides, and `together` (one batch on both sides;
    then within 1e-5 of the latents' largest magnitude: a batch of 3 tiny-video rows differs
    by 2.6e-5 at 4.9 without any adapter); `kw`: the sequence-parallel one's alone."""
    one, split = tmp / "one", tmp / "split"
    one.mkdir()
    split.mkdir()
    msgs = _sequence_parallel(model, n, requests, split, **(both or {}), **kw)
    results = {m.output.request_id: m.output for m in msgs if isinstance(m, RequestResult)}
    assert all(out.error is None for out in results.values()), results
    want = _reference(model, requests, one, **(both or {}))
    for rid, ref in want.items():
        got, latents = torch.load(split / f"{rid}.pt"), torch.load(one / f"{rid}.pt")
        bound = TOLERANCE * (max(1.0, latents.abs().max().item()) if both else 1.0)
        assert got.shape == latents.shape and (got - latents).abs().max() <= bound, rid
        assert np.abs(_pixels(results[rid]) - _pixels(ref)).max() <= 1, rid
    whole = sorted({int(t) for t in (one / "tokens-rank0.txt").read_text().split()})
    shares = [(split / f"tokens-rank{r}.txt").read_text().split() for r in range(n)]
    assert all(s == shares[0] for s in shares)  # the same forwards on every rank
    assert sorted({int(t) for t in shares[0]}) == [-(-t // n) for t in whole]
    return msgs, whole


def check_patch_decoded(tmp: Path, n: int) -> None:
    """Every rank decoded (the Wan VAE's patch-parallel decode), each its band's rows only."""
    whole = max(int(t) for t in (tmp / "one" / "decoded-rank0.txt").read_text().split())
    for r in range(n):
        made = [int(t) for t in (tmp / "split" / f"decoded-rank{r}.txt").read_text().split()]
        assert made and max(made) < whole, (r, made, whole)


def _ti2v_requests() -> list[StageRequest]:
    """Wan2.2-TI2V's tiny model: 5 x 3 x 5 = 75 tokens (9 frames at 48x80) and 3 x 3 x 3 = 27
    (5 frames at 48x48), a timestep per token."""
    return [
        _request(
            "t75", "text2video", seed=5, num_inference_steps=4, num_frames=9, width=80, height=48
        ),
        _request(
            "t27", "text2video", seed=6, num_inference_steps=3, num_frames=5, width=48, height=48
        ),
    ]


def test_ti2v_videos_equal_one_rank_two_lengths_in_one_set(tmp_path):
    """2 ranks; token counts that do not divide by 2 (75, 27); the second group steps beside
    the first in the running set."""
    msgs, whole = check_equal_to_one_rank(tiny_wan22_ti2v_path(), 2, _ti2v_requests(), tmp_path)
    assert whole == [27, 75]
    check_patch_decoded(tmp_path, 2)
    first_done = next(i for i, m in enumerate(msgs) if isinstance(m, BatchDone))
    stepped = [m.batch_id for m in msgs[:first_done] if isinstance(m, Progress)]
    assert {1, 2} <= set(stepped), "the two groups did not step in one set"


@pytest.mark.drill
def test_ti2v_image_to_video_equals_one_rank(tmp_path):
    """A row from a first frame on our loop (the frame's latents put back, its tokens at
    timestep 0): its transformer's forwards split, its decode in bands."""
    request = StageRequest(
        "i2v",
        "a red circle",
        GenerationParams(seed=8, num_inference_steps=3, num_frames=5, width=80, height=48),
        mode="image2video",
        images=[EDIT_IMAGE],
    )
    check_equal_to_one_rank(tiny_wan22_ti2v_path(), 2, [request], tmp_path)
    check_patch_decoded(tmp_path, 2)


@pytest.mark.drill  # (four ranks on two cores)
def test_ti2v_videos_equal_one_rank_on_4_ranks(tmp_path):
    whole = check_equal_to_one_rank(tiny_wan22_ti2v_path(), 4, _ti2v_requests(), tmp_path)[1]
    assert whole == [27, 75]
    check_patch_decoded(tmp_path, 4)


@pytest.mark.drill
@pytest.mark.parametrize("n", [2, 3, 4])
def test_flux_images_equal_one_rank(tmp_path, n):
    """60 and 140 image tokens (48x80 and 112x80: the tiny VAE's factor is 4, so a FLUX.1
    size, a multiple of 16, always gives a multiple of 4; 3 ranks divide neither, and split
    its 2 heads unevenly), two images of one request, a text of 24 tokens every rank holds
    whole."""
    requests = [
        _request("short", "text2img", seed=1, num_inference_steps=4, width=80, height=48, n=2),
        _request("long", "text2img", seed=2, num_inference_steps=3, width=80, height=112),
    ]
    assert check_equal_to_one_rank(tiny_flux_path(), n, requests, tmp_path)[1] == [60, 140]


@pytest.mark.drill
@pytest.mark.parametrize("n", [2, 4])
def test_wan21_videos_equal_one_rank(tmp_path, n):
    """The embedded tiny-video model (Wan2.1's shape): 5 and 9 frames in one set (its sizes,
    multiples of 16 over a VAE of factor 4, always give a multiple of 4 tokens)."""
    requests = [
        _request("v9", "text2video", seed=3, num_inference_steps=3, num_frames=9),
        _request("v5", "text2video", seed=4, num_inference_steps=3, num_frames=5, width=48),
    ]
    check_equal_to_one_rank("tiny-video", n, requests, tmp_path)
    check_patch_decoded(tmp_path, n)


@pytest.mark.drill
def test_wan22_two_experts_equal_one_rank(tmp_path):
    """A14B's shape: the high-noise expert, then the low-noise one; both split."""
    requests = [
        _request(
            "a", "text2video", seed=6, num_inference_steps=4, num_frames=5, width=64, height=64
        )
    ]
    check_equal_to_one_rank(tiny_wan22_experts_path(), 2, requests, tmp_path)


@pytest.mark.drill
def test_a_compiled_replica_equals_one_rank(tmp_path):
    """Compiled (dynamo's eager backend: real tracing, no C compiler), the split inside the
    compiled graph: rank 0's warm-up at load drives the others' (they serve its forwards)."""
    compiled = {"compile": True, "batch_buckets": (1,), "options": {"compile_backend": "eager"}}
    requests = [_request("c", "text2video", seed=7, num_inference_steps=3, num_frames=9)]
    check_equal_to_one_rank("tiny-video", 2, requests, tmp_path, **compiled)


def test_lora_adapters_mixed_in_one_batch_equal_one_rank(tmp_path):
    """Every rank holds the LoRA pool: a row with one adapter, one with two (another scale) and
    a base row in one batch (its slots written on rank 0 at the join and copied to rank 1; each
    forward's rows go with it) equal one rank's running the same batch (a row's float rounding
    depends on its batch's rows: alone, a row is within a level of it, test_lora.py)."""
    loras, requests = lora_videos(tmp_path)
    both = {"loras": loras, "max_lora_rank": 4, "together": True}
    check_equal_to_one_rank("tiny-video", 2, requests, tmp_path, both=both)
    got = {r: torch.load(tmp_path / "one" / f"{r}.pt") for r in ("v", "base")}
    assert (got["v"] - got["base"]).abs().mean() > 0.01  # (the adapter does something)
