"""Where a step's time goes: torch.profiler traces of chosen batches, and every batch's timeline.

    VLLM_OMNI_LIKE_TRACE_DIR=/tmp/traces VLLM_OMNI_LIKE_TRACE_BATCHES=2 vllm-omni-like serve ...

Each worker traces its own `n`-th batches (counted per worker from 1: rank 0's denoising loops,
a CFG-parallel rank 1's served branches) and writes `<dir>/<stage>-rank<r>-batch<n>.json.gz`
(Chrome trace format: chrome://tracing or https://ui.perfetto.dev). A trace costs time, so
figures are never taken from a traced batch (`VLLM_OMNI_LIKE_TRACE_BATCHES=` traces none).

Every batch also gets one line in `<dir>/<stage>-rank<r>-timeline.jsonl`: the device's clock at
the marks the stage set (rank 0: the call's start and each step's end; rank 1: each branch's
start and end), one CUDA event each, read once the batch ended: what a step takes on the device,
without the profiler's overhead. Off unless the directory is set.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)
TRACE_DIR_ENV = "VLLM_OMNI_LIKE_TRACE_DIR"
TRACE_BATCHES_ENV = "VLLM_OMNI_LIKE_TRACE_BATCHES"  # comma-separated batch counts; default 2


class BatchTracer:
    """Counts one worker's batches and traces those the environment names."""

    def __init__(self, stage: str, rank: int, device: Any = None) -> None:
        self.directory = os.environ.get(TRACE_DIR_ENV, "")
        wanted = os.environ.get(TRACE_BATCHES_ENV, "2")
        self.batches = {int(n) for n in wanted.split(",") if n.strip()}
        self.stage, self.rank, self.count = stage, rank, 0
        self.device = device  # a CUDA device: the marks go on its current stream
        self._marks: list[tuple[str, Any]] = []

    def mark(self, label: str) -> None:
        """A point of this batch's timeline, on the device's clock (no wait for the device)."""
        if not self.directory:
            return
        import torch

        if self.device is not None and torch.device(self.device).type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self._marks.append((label, event))
        else:
            self._marks.append((label, time.perf_counter()))

    def _write_timeline(self) -> None:
        marks, self._marks = self._marks, []
        if not marks:
            return
        first = marks[0][1]
        if isinstance(first, float):
            at = [1000 * (t - first) for _, t in marks]
        else:
            marks[-1][1].synchronize()
            at = [first.elapsed_time(e) for _, e in marks]
        line = {
            "batch": self.count,
            "labels": [m[0] for m in marks],
            "ms": [round(t, 3) for t in at],
        }
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"{self.stage}-rank{self.rank}-timeline.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        self.count += 1
        self._marks = []
        with self._profiled():
            yield
        if self.directory:  # (not after a failure: its device may be gone)
            self._write_timeline()

    @contextlib.contextmanager
    def _profiled(self) -> Iterator[None]:
        if not self.directory or self.count not in self.batches:
            yield
            return
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        with profile(activities=activities) as prof:
            yield
        os.makedirs(self.directory, exist_ok=True)
        name = f"{self.stage}-rank{self.rank}-batch{self.count}.json.gz"
        path = os.path.join(self.directory, name)
        prof.export_chrome_trace(path)
        logger.info("stage %s rank %d traced batch %d: %s", self.stage, self.rank, self.count, name)
