"""What the tests of a replica of several ranks (CFG-parallel, sequence parallel, both) share:
one replica's executor started with a probe's environment, its messages collected until its
groups end and its ranks gone (tests/stages/test_cfg_parallel_loop.py, test_sequence_parallel.py);
a served replica's ranks, the wait until they are all gone, and a request aborted mid-step
beside the next one (tests/stages/test_cfg_parallel.py, test_sequence_parallel_deaths.py);
tiny-video's LoRA batch that every rank layout must run as one rank does
(test_sequence_parallel.py, test_cfg_parallel_lora.py)."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import torch

from tests.engine.helpers import final
from vllm_omni_like.config import StageConfig
from vllm_omni_like.executor import MultiprocExecutor
from vllm_omni_like.inputs import OmniRequest
from vllm_omni_like.outputs import OmniRequestOutput
from vllm_omni_like.params import GenerationParams, LoraRef
from vllm_omni_like.wire import BatchDone, StageRequest


class ProbedReplica:
    """One replica's executor (`ex`) and what it sent (`msgs`, as `until_done` collects)."""

    def __init__(self, config: StageConfig) -> None:
        self.sink: queue.Queue = queue.Queue()
        self.ex = MultiprocExecutor(config, 0, self.sink.put)
        self.msgs: list[object] = []

    def until_done(self, groups: int, each: Callable[[], None] = lambda: None) -> list[object]:
        """The messages, once `groups` batches are done (within 120 s, the replica alive);
        `each`: called after each wait for a message (a test's later sends)."""
        deadline = time.monotonic() + 120
        while sum(isinstance(m, BatchDone) for m in self.msgs) < groups:
            assert self.ex.alive, "the replica died (its workers' log says why)"
            assert time.monotonic() < deadline, "the groups did not end within 120 s"
            with contextlib.suppress(queue.Empty):
                self.msgs.append(self.sink.get(timeout=0.1))
            each()
        return self.msgs


@contextlib.contextmanager
def probed_replica(config: StageConfig, env: str, where: Path) -> Iterator[ProbedReplica]:
    """One replica of `config`, its workers started with `env` naming `where` (a probe stage's
    output directory); shut down on leaving, every rank gone."""
    replica = ProbedReplica(config)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(env, str(where))
        replica.ex.start()
    try:
        yield replica
    finally:
        pids = replica.ex.pids
        replica.ex.shutdown()
    assert len(pids) == config.workers_per_replica and not any(psutil.pid_exists(p) for p in pids)


def ranks_of(replica, n: int) -> list[int]:
    """The pids of a live replica's `n` ranks (empty while it is down)."""
    executor = replica.executor
    pids = executor.pids if executor is not None and replica.live else []
    return pids if len(pids) == n else []


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def watch_gone(pids: list[int]) -> list[float]:
    """When every process of `pids` is gone (appended by a thread; bounded to 60 s)."""
    gone_at: list[float] = []

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(gone(p) for p in pids):
            time.sleep(0.005)
        gone_at.append(time.monotonic())

    threading.Thread(target=watch, daemon=True).start()
    return gone_at


def abort_mid_step(
    eng, cut: OmniRequest, after: OmniRequest, stepped_s: float
) -> tuple[OmniRequestOutput, OmniRequestOutput]:
    """`cut` aborted once it reported its third step (within `stepped_s`), then `after` run:
    both final outputs."""

    async def main():
        stepped = asyncio.Event()

        async def run():
            async for ev in eng.generate(cut):
                if isinstance(ev, OmniRequestOutput):
                    return ev
                if ev.step >= 3:
                    stepped.set()
            raise AssertionError("no final output")

        task = asyncio.create_task(run())
        await asyncio.wait_for(stepped.wait(), stepped_s)
        eng.abort(cut.request_id)
        return await asyncio.wait_for(task, 10), await final(eng, after)

    return asyncio.run(main())


def lora_videos(where: Path) -> tuple[tuple[str, str], list[StageRequest]]:
    """Two adapters of tiny-video's transformer (v and w, on its attention and MLP layers)
    written under `where`, as a stage's `loras`; and one batch of three rows: one of v, a base
    row of the same seed (what v changes), one of v at 0.7 with w."""
    import diffusers

    from tests.stages.diffusion.lora_helpers import low_rank, write_peft
    from vllm_omni_like.models.tiny import ensure_tiny_model

    model = diffusers.WanTransformer3DModel.from_pretrained(
        ensure_tiny_model("tiny-video"), subfolder="transformer", dtype=torch.float32
    )
    ends = ("attn1.to_q", "attn2.to_v", "ffn.net.2")
    v, w = (
        write_peft(where / f"{n}.safetensors", low_rank(model, s, 4, ends, 0.5), "transformer")
        for n, s in (("v", 1), ("w", 2))
    )

    def video(rid: str, seed: int, *refs: LoraRef) -> StageRequest:
        params = GenerationParams(seed=seed, num_inference_steps=3, num_frames=5, loras=refs)
        return StageRequest(rid, "a red circle", params, mode="text2video")

    rows = [
        video("v", 3, LoraRef("v")),
        video("base", 3),
        video("vw", 5, LoraRef("v", 0.7), LoraRef("w")),
    ]
    return (f"v={v}", f"w={w}"), rows
