"""Stages for the engine's tests (kind 'tests.engine.stage_doubles:Class'): the null stage,
plus a torch.compile that takes a while, a decode that holds the device's memory, or a batch that
waits for the test to let it run."""

from __future__ import annotations

import os
import re
import threading
import time

from vllm_omni_like.stages.base import Deferred, StageControl
from vllm_omni_like.stages.null import NullStage
from vllm_omni_like.wire import OffloadReport, StageRequest

COMPILE_S = 1.5  # what one compilation of CompilingStage takes (over the cold bound of 1 s)
DECODE_S = 0.6  # how long DecodeHoldsMemoryStage's decode holds its memory
GATE_S = 60.0  # the longest a GatedStage batch waits for its gate (a test that never opens it)


class CompilingStage(NullStage):
    """Each new batch size compiles a small function with torch.compile before the null steps
    run; its backend takes COMPILE_S (a real Dynamo compile: its start and end callbacks fire)."""

    def load(self, device: str) -> None:
        super().load(device)
        import torch

        def slow_backend(gm, example_inputs):
            time.sleep(COMPILE_S)
            return gm.forward

        self.torch = torch
        self.fn = torch.compile(lambda x: x * 2 + 1, backend=slow_backend, dynamic=False)

    def begin(self, batch: list[StageRequest], control: StageControl) -> Deferred:
        self.fn(self.torch.ones(len(batch)))  # a batch size not seen yet compiles now
        return super().begin(batch, control)


class DecodeHoldsMemoryStage(NullStage):
    """A batch holds the device's memory from the end of its denoising until its decode (of
    DECODE_S) is done: a batch that begins meanwhile runs out of memory, as a real one would
    with the latents and pixels of the batch before still on the device."""

    def load(self, device: str) -> None:
        super().load(device)
        self.held = threading.Event()
        self.out_of_memory = 0  # begins that ran out of memory

    def begin(self, batch: list[StageRequest], control: StageControl) -> Deferred:
        if self.held.is_set():
            self.out_of_memory += 1
            raise MemoryError("out of memory: the batch being decoded holds it")
        part = super().begin(batch, control)
        self.held.set()  # its latents stay on the device until its decode is done

        def finish(requests: list[StageRequest]):
            try:
                time.sleep(DECODE_S)
                return part.finish(requests)
            finally:
                self.held.clear()

        return Deferred(part.requests, finish)


class GatedStage(NullStage):
    """A batch with a prompt that says '@gate=PATH' waits at its begin, before its first step,
    until the file PATH exists (GATE_S at most, then it fails): a test holds the replica with
    it, so that nothing else runs there, drains or reports a step until the test creates PATH."""

    def begin(self, batch: list[StageRequest], control: StageControl) -> Deferred:
        for r in batch:
            match = re.search(r"@gate=(\S+)", r.prompt)
            if match is None:
                continue
            deadline = time.monotonic() + GATE_S
            while not os.path.exists(match.group(1)):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gate {match.group(1)} not opened in {GATE_S:g}s")
                time.sleep(0.01)
        return super().begin(batch, control)


class OffloadingStage(NullStage):
    """Reports an idle-expert offload (`Stage.offload`) whose swaps count its batches: the
    report's way from the worker (WorkerReady, BatchDone) to /health and /metrics."""

    def load(self, device: str) -> None:
        super().load(device)
        self.batches = 0

    def begin(self, batch: list[StageRequest], control: StageControl) -> Deferred:
        self.batches += 1
        return super().begin(batch, control)

    def offload(self) -> OffloadReport | None:
        resident = "transformer_2" if self.batches % 2 else "transformer"
        last = 0.25 if self.batches else None
        return OffloadReport("idle-expert", resident, self.batches, last, 1000, 2000)
