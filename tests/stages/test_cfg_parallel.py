"""CFG-parallel (parallel/cfg_parallel.py) on the CPU: two gloo ranks per replica in real worker
processes, rank 0 running our own loop (tests/stages/test_cfg_parallel_loop.py: its latents
against one rank's, the families, joins). The same images and videos as one rank at the same
seed; a rank that dies or stops mid-step takes its replica down at once, which restarts whole,
and the request re-runs."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import queue
import signal
import time

import numpy as np
import psutil
import pytest

from tests.conftest import drain_batch, wait_for
from tests.engine.helpers import engine, final, req
from tests.stages.replica_ranks import abort_mid_step, ranks_of, watch_gone
from vllm_omni_like.config import StageConfig
from vllm_omni_like.engine import stage_pool
from vllm_omni_like.errors import ConfigError
from vllm_omni_like.executor import MultiprocExecutor, placement
from vllm_omni_like.models.stable_diffusion.adapter import StableDiffusionAdapter
from vllm_omni_like.models.tiny import image_pipeline
from vllm_omni_like.outputs import OmniRequestOutput
from vllm_omni_like.parallel import cfg_parallel
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.pipelines.catalog import resolve
from vllm_omni_like.stages.base import StageControl, create_stage
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.stages.trace import TRACE_BATCHES_ENV, TRACE_DIR_ENV
from vllm_omni_like.wire import BatchDone, ExecuteBatch, RequestResult, StageRequest

pytestmark = pytest.mark.slow
KW = {"cfg_parallel": True, "device": "cpu", "stall_timeout": 1.0, "cold_step_timeout": 30.0}
LONG = 16  # steps of the requests a rank is signalled in the middle of


def _reference(spec: str, device: str = "cpu"):
    """One rank, in this process: what CFG-parallel must reproduce."""
    config = resolve(spec, device=device)[0].stages[0]
    stage = create_stage(config)
    stage.load(device)
    control = StageControl(FaultInjector((), config.name))

    def run(params: GenerationParams, mode: str = "text2img"):
        out = stage.execute([StageRequest("ref", "a red circle", params, mode=mode)], control)[0]
        assert out.error is None, out.error
        return out

    return run


@pytest.fixture(scope="module")
def reference_image():
    return _reference("tiny-image")


@pytest.fixture(scope="module")
def cfgp():
    """tiny-image with one CFG-parallel replica (whose rank 1 fails its branch for 96 and 128
    pixel images: tests/stages/branch_fault.py); restarts without back-off, so that the fault
    tests below each find it ready again within a load's time."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stage_pool, "RESTART_BACKOFF_S", (0.0,))
        kind = "tests.stages.branch_fault:BranchFaultStage"
        with engine("tiny-image", stage_kw=KW, stage_kind=kind, max_restarts=20) as eng:
            yield eng


def _pixels(out: OmniRequestOutput) -> list[np.ndarray]:
    assert out.ok, out.error
    return [img.pixels.astype(int) for img in out.output.images]


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> int:
    assert len(a) == len(b)
    return max(int(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def test_config_takes_devices_two_by_two():
    two = StageConfig(name="d", kind="diffusion", cfg_parallel=True, devices=(0, 1, 2, 3))
    assert (two.replicas, two.workers_per_replica) == (2, 2)
    assert placement.rank_devices(two, 1) == ("cuda:2", "cuda:3")
    assert placement.replica_label(two, 0) == "cuda:0,cuda:1"
    cpu = StageConfig(name="d", kind="diffusion", cfg_parallel=True, device="cpu")
    assert placement.rank_devices(cpu, 0) == ("cpu", "cpu") and cpu.replicas == 1
    for bad, why in (
        ({"devices": (0, 1, 2)}, "two by two"),
        ({"devices": (1, 1)}, "two GPUs"),
        ({"kind": "llm"}, "diffusion stages only"),
        ({"workers_per_replica": 3}, "2 workers"),
    ):
        with pytest.raises(ConfigError, match=why):
            StageConfig(**{"name": "d", "kind": "diffusion", "cfg_parallel": True, **bad})
    # a whole pipeline's flag leaves its LLM stage alone
    llm, diffusion = resolve("tiny-omni", cfg_parallel=True)[0].stages
    assert (llm.cfg_parallel, diffusion.cfg_parallel) == (False, True)


def test_rank_1_keeps_only_the_denoiser():
    """Rank 1 never encodes text nor decodes: its pipeline drops all models but the denoiser."""
    pipe = image_pipeline()
    dropped = cfg_parallel.keep_only(pipe, StableDiffusionAdapter(pipe).keep_for_branches())
    assert {"text_encoder", "vae"} <= set(dropped) and "unet" not in dropped
    assert pipe.text_encoder is None and pipe.vae is None and pipe.unet is not None


def test_pinning_a_rank_shows_it_its_peer_after_its_own_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert placement.pin("cuda:3", ("cuda:2",)) == "cuda:0"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,2"


def test_images_equal_one_rank_and_rank_0_computes_half_the_batch(cfgp, reference_image):
    """Guided requests: rank 0's model sees the conditional half only (1 row, not 2), rank 1
    computes the other; pixels within 2 of one rank's at the same seed. Without guidance rank
    0 runs alone; n=2 keeps consecutive seeds."""
    cases = [
        ({"seed": 1}, 1),
        ({"seed": 2, "guidance_scale": 7.5}, 1),
        ({"seed": 3, "guidance_scale": 1.0}, 1),  # no CFG: rank 0 alone, one row
        ({"seed": 4, "n": 2}, 2),
    ]

    async def main():
        return [
            await final(cfgp, req(f"eq{i}", "a red circle", "tiny-image", steps=4, **kw))
            for i, (kw, _) in enumerate(cases)
        ]

    outs = asyncio.run(main())
    for (kw, rows), out in zip(cases, outs, strict=True):
        want = reference_image(GenerationParams(num_inference_steps=4, **kw))
        assert _max_diff(_pixels(out), [i.pixels.astype(int) for i in want.images]) <= 2
        (report,) = [b for b in cfgp.batches if out.request_id in b.steps_run]
        assert report.model_batch == rows, (kw, report)


@pytest.mark.drill  # (the suite's time; tests/models/ checks Wan's split in one process)
def test_a_video_equals_one_rank(tmp_path, monkeypatch):
    """Wan: each step's unconditional forward is rank 1's. Compiled (dynamo's eager
    backend: real tracing, no C compiler): rank 0's warm-up at load drives rank 1's. Both
    ranks write their timelines (stages/trace.py): rank 0 a step's end per step, rank 1 each
    branch's start and end."""
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(TRACE_BATCHES_ENV, "")  # timelines only, no profiler
    compiled = {"compile": True, "batch_buckets": (1,), "options": {"compile_backend": "eager"}}
    config = StageConfig(name="diffusion", kind="diffusion", model="tiny-video", **KW, **compiled)
    sink: queue.Queue = queue.Queue()
    ex = MultiprocExecutor(config, 0, sink.put)
    ex.start()
    try:
        params = GenerationParams(seed=5, num_inference_steps=4, num_frames=9)
        ex.execute(ExecuteBatch(1, [StageRequest("v", "a red circle", params, mode="text2video")]))
        msgs = drain_batch(sink, 1, timeout=60)
    finally:
        pids = ex.pids
        ex.shutdown()
    assert not any(psutil.pid_exists(p) for p in pids)
    (result,) = [m.output for m in msgs if isinstance(m, RequestResult)]
    done = msgs[-1]
    assert isinstance(done, BatchDone) and done.model_batch_dim == 1  # its half, not 2 rows
    monkeypatch.delenv(TRACE_DIR_ENV)  # (the reference's own timeline would join rank 0's)
    want = _reference("tiny-video")(params, mode="text2video")
    got, ref = result.video.frames.astype(int), want.video.frames.astype(int)
    assert got.shape == ref.shape == (9, 64, 64, 3) and np.abs(got - ref).max() <= 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "diffusion-rank0-timeline.jsonl",
        "diffusion-rank1-timeline.jsonl",
    ]
    lines = (tmp_path / "diffusion-rank0-timeline.jsonl").read_text().splitlines()
    # our own loop's running set: the warm-up's two batches (without guidance: rank 0 alone;
    # with it), then the request's, each from its rows' join
    plain, guided, leader = [json.loads(line) for line in lines]
    assert plain["labels"] == ["begin", "joined", "step", "step", "synced"]
    assert guided["labels"] == ["begin", "joined"] + ["local", "local_done", "step"] * 2 + [
        "synced"
    ]
    assert leader["labels"] == ["begin", "joined"] + ["local", "local_done", "step"] * 4 + [
        "synced"
    ]
    assert leader["ms"] == sorted(leader["ms"]) and leader["ms"][0] == 0
    lines = (tmp_path / "diffusion-rank1-timeline.jsonl").read_text().splitlines()
    warm_up, served = [json.loads(line) for line in lines]
    assert warm_up["labels"] == ["begin"] + ["branch", "done"] * 2  # the warm-up's 2 steps
    assert served["labels"] == ["begin"] + ["branch", "done"] * 4
    assert served["ms"] == sorted(served["ms"]) and served["host_ms"] == sorted(served["host_ms"])
    # one clock for both ranks' hosts: rank 1 began serving the batch while rank 0 ran it
    assert leader["t0"] - 5 < served["t0"] < leader["t0"] + leader["host_ms"][-1] / 1000


def test_a_failed_branch_on_rank_1_fails_its_request_and_the_replica_stays(cfgp):
    """Out of memory on rank 1's first call, and an error on its third (reported after the
    pipeline call, as the steps never wait for rank 1's status): each request ends with a
    500 naming it; no restart (the same two processes), and the next request succeeds."""
    replica = cfgp.orchestrator.pools["tiny-image"][0].replicas[0]
    before = wait_for(lambda: ranks_of(replica, 2), 60, "the replica ready with its two ranks")

    async def main():
        return [
            await final(
                cfgp, req(rid, "a red circle", "tiny-image", 4, seed=1, width=side, height=side)
            )
            for rid, side in (("oom", 96), ("fail", 128), ("fine", 64))
        ]

    oom, fail, fine = asyncio.run(main())
    assert (
        oom.error.status == 500
        and "rank 1: MemoryError: simulated out of memory" in oom.error.message
    )
    assert fail.error.status == 500 and "rank 1's branch failed" in fail.error.message
    assert fine.ok, fine.error
    assert replica.executor.pids == before and replica.live


def test_an_abort_mid_step_stops_both_ranks_and_the_replica_serves_on(cfgp, reference_image):
    """Rank 0 alone decides: it stops at its next step boundary and ends rank 1's batch; the
    next request runs on the same two processes to the right image."""
    replica = cfgp.orchestrator.pools["tiny-image"][0].replicas[0]
    before = wait_for(lambda: ranks_of(replica, 2), 60, "the replica ready with its two ranks")
    cut, after = abort_mid_step(
        cfgp,
        req("cut", "a red circle", "tiny-image", LONG, seed=9),
        req("after-cut", "a red circle", "tiny-image", 4, seed=1),
        stepped_s=30,
    )
    assert cut.error is not None and cut.error.code == "aborted"
    (report,) = wait_for(
        lambda: [b for b in cfgp.batches if "cut" in b.steps_after_abort], 10, "the cut batch"
    )
    assert report.steps_after_abort["cut"] <= 1 and report.steps_run["cut"] < LONG
    want = reference_image(GenerationParams(num_inference_steps=4, seed=1))
    assert _max_diff(_pixels(after), [i.pixels.astype(int) for i in want.images]) <= 2
    assert ranks_of(replica, 2) == before


def signal_mid_step(eng, pipeline: str, sig: int, rank: int, steps: int, seed: int):
    """Signal `rank` of the pipeline's replica once a request of `steps` steps reported its
    third; the request's final output, the seconds until both ranks were gone and the bound:
    1 s after a kill; after a stop, the engine's stall bound for the running batch at that
    moment, plus 1.5 s for the stall check's period and the kill."""
    replica = eng.orchestrator.pools[pipeline][0].replicas[0]
    old = wait_for(lambda: ranks_of(replica, 2), 120, "the replica ready with its two ranks")
    watched: list[list[float]] = []  # (when every old rank was gone, watched from the signal)
    bound: list[float] = []

    async def main():
        signalled = None
        request = req(f"sig-{sig}-{rank}", "a red circle", pipeline, steps, seed=seed)
        async for ev in eng.generate(request):
            if isinstance(ev, OmniRequestOutput):
                return ev, signalled
            if signalled is None and ev.step >= 3:
                stall_s = replica.clock.bound()[0]
                os.kill(old[rank], sig)
                signalled = time.monotonic()
                bound.append(1.0 if sig == signal.SIGKILL else stall_s + 1.5)
                watched.append(watch_gone(old))
        raise AssertionError("no final output")

    out, signalled = asyncio.run(main())
    assert signalled is not None
    (gone_at,) = watched
    wait_for(lambda: gone_at, 65, "the watcher's verdict")
    new = wait_for(lambda: ranks_of(replica, 2), 120, "the restarted replica")
    assert len(new) == 2 and not set(new) & set(old)
    return out, gone_at[0] - signalled, bound[0]


@pytest.mark.parametrize(
    ("sig", "rank"),
    [
        pytest.param(signal.SIGKILL, 0, marks=pytest.mark.drill),  # (the suite's time: -m drill)
        (signal.SIGKILL, 1),
        pytest.param(signal.SIGSTOP, 0, marks=pytest.mark.drill),  # (~55 s: kill-rank1 stays)
        pytest.param(signal.SIGSTOP, 1, marks=pytest.mark.drill),
    ],
    ids=["kill-rank0", "kill-rank1", "stop-rank0", "stop-rank1"],
)
def test_a_rank_killed_or_stopped_mid_step_takes_its_replica_down(cfgp, reference_image, sig, rank):
    """Mid-step, one rank is signalled: both ranks are gone within the bound, the replica
    restarts whole (two new processes), and the request re-runs there to the same image."""
    out, took, bound = signal_mid_step(cfgp, "tiny-image", sig, rank, LONG, seed=7)
    assert took <= bound, f"both ranks gone after {took:.2f}s (bound {bound:.2f}s)"
    want = reference_image(GenerationParams(num_inference_steps=LONG, seed=7))
    assert _max_diff(_pixels(out), [i.pixels.astype(int) for i in want.images]) <= 2
    health = cfgp.health()[0]
    assert [r["state"] for r in health["replicas"]] == ["ready"]


@pytest.mark.drill  # (the suite's time: two real ranks and a reference)
def test_fp8_ranks_make_the_image_one_fp8_rank_makes():
    """`--quantization fp8` with CFG-parallel (the tiny SD3.5: its pipeline doubles its batch,
    each rank runs a half): each rank quantizes its own denoiser at load (the replica says
    fp8), and the image is one FP8 rank's at the same seed. (Not the trained tiny-video: its
    FP8 trajectory follows a 1e-6 difference in the prompt's embeddings - the stage's own
    encoding against the pipeline's, which the two paths use - 24 dB apart after 3 steps.)"""
    from tests.models.tiny_mmdit import tiny_sd3_path

    config = StageConfig(
        name="diffusion", kind="diffusion", model=tiny_sd3_path(), quantization="fp8", **KW
    )
    sink: queue.Queue = queue.Queue()
    ex = MultiprocExecutor(config, 0, sink.put)
    ex.start()
    try:
        assert ex.precision == "fp8"
        params = GenerationParams(seed=5, num_inference_steps=3, guidance_scale=4.0)
        ex.execute(ExecuteBatch(1, [StageRequest("i", "a red circle", params)]))
        msgs = drain_batch(sink, 1, timeout=60)
    finally:
        ex.shutdown()
    (result,) = [m.output for m in msgs if isinstance(m, RequestResult)]
    assert msgs[-1].model_batch_dim == 1  # its half of the guidance rows
    one = create_stage(dataclasses.replace(config, cfg_parallel=False, workers_per_replica=1))
    one.load("cpu")
    control = StageControl(FaultInjector((), "diffusion"))
    (want,) = one.execute([StageRequest("ref", "a red circle", params)], control)
    got, ref = result.images[0].pixels.astype(int), want.images[0].pixels.astype(int)
    assert np.abs(got - ref).max() <= 2
