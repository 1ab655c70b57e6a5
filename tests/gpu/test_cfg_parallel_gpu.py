"""CFG-parallel on two GPUs (NCCL); skipped without two CUDA devices (CI). The CPU tests of the
same logic (gloo): tests/stages/test_cfg_parallel.py."""

from __future__ import annotations

import asyncio
import signal

import numpy as np
import pytest
import torch

from tests.engine.helpers import engine, final, req
from tests.stages.test_cfg_parallel import _reference, signal_mid_step
from vllm_omni_like.engine import stage_pool
from vllm_omni_like.params import GenerationParams

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
KW = {"cfg_parallel": True, "devices": (0, 1), "stall_timeout": 1.0, "cold_step_timeout": 120.0}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def test_images_and_videos_match_one_gpu():
    """fp16 on two GPUs against one GPU at the same seeds: PSNR >= 35 dB."""
    for spec, extra in (("tiny-image", {}), ("tiny-video", {"num_frames": 9})):
        with engine(spec, stage_kw=KW) as eng:
            outs = [
                asyncio.run(final(eng, req(f"{spec}{s}", "a red circle", spec, 8, seed=s, **extra)))
                for s in (1, 2)
            ]
            health = eng.health()[0]["replicas"]
        assert [r["device"] for r in health] == ["cuda:0,cuda:1"]
        reference = _reference(spec, "cuda:0")
        for s, out in zip((1, 2), outs, strict=True):
            assert out.ok, out.error
            mode = "text2video" if extra else "text2img"
            want = reference(GenerationParams(num_inference_steps=8, seed=s, **extra), mode)
            got = out.output.video.frames if extra else out.output.images[0].pixels
            ref = want.video.frames if extra else want.images[0].pixels
            assert psnr(got, ref) >= 35.0, (spec, s, psnr(got, ref))


@pytest.mark.parametrize(("sig", "rank"), [(signal.SIGKILL, 1), (signal.SIGSTOP, 0)])
def test_a_rank_lost_mid_step_takes_its_replica_down_on_gpus(sig, rank):
    """Rank 1 killed while rank 0 waits on it in NCCL, or rank 0 stopped while rank 1 waits: both
    ranks are gone within the bound (1 s after a kill; the stall bound, its check and the kill
    after a stop), the replica restarts whole and the request re-runs."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(stage_pool, "RESTART_BACKOFF_S", (0.0,))
        with engine("tiny-image", stage_kw=KW) as eng:
            out, took, bound = signal_mid_step(eng, "tiny-image", sig, rank, 200, seed=3)
    assert out.ok, out.error
    assert took <= bound, f"both ranks gone after {took:.2f}s (bound {bound:.2f}s)"
    print(f"{signal.Signals(sig).name} rank {rank}: both ranks gone after {took:.3f}s")


def _header_rank(rank: int, rendezvous: str, sleep_cycles: int, took) -> None:
    import time

    from vllm_omni_like.parallel.cfg_parallel import Link
    from vllm_omni_like.parallel.ranks import Ranks

    link = Link(Ranks(rank, 2, rendezvous), torch.device("cuda", rank), timeout_s=60.0)
    if rank == 0:
        torch.cuda._sleep(sleep_cycles)  # the device busy for a while: an earlier step
        link.send(torch.ones(4, device="cuda:0"))  # queued behind it on the device
        link.send_obj(("call", "header"))  # the host does not wait for it
    else:
        start = time.monotonic()
        assert link.recv_obj() == ("call", "header")
        took.value = time.monotonic() - start
        assert link.recv((4,), "float32").sum().item() == 4.0
    torch.cuda.synchronize()
    link.close()


def test_a_header_reaches_rank_1_before_rank_0s_device_reaches_the_step(tmp_path):
    """The header goes host to host: rank 1 reads it while rank 0's device is still busy with
    the previous work (about 1 s here), so it can launch its branch ahead of the data."""
    ctx = torch.multiprocessing.get_context("spawn")
    took = ctx.Value("d", -1.0)
    cycles = 2_000_000_000  # about 1 s at H100/H200 clocks
    procs = [
        ctx.Process(target=_header_rank, args=(r, str(tmp_path / "rdv"), cycles, took))
        for r in (0, 1)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert 0 <= took.value < 0.3, f"rank 1 read the header after {took.value:.3f}s"
