"""torch.profiler traces of chosen batches, for finding where a step's time goes.

    VLLM_OMNI_LIKE_TRACE_DIR=/tmp/traces VLLM_OMNI_LIKE_TRACE_BATCHES=2 vllm-omni-like serve ...

Each worker traces its own `n`-th batches (counted per worker from 1: rank 0's denoising loops,
a CFG-parallel rank 1's served branches) and writes `<dir>/<stage>-rank<r>-batch<n>.json.gz`
(Chrome trace format: chrome://tracing or https://ui.perfetto.dev). Off unless the directory is
set; a trace costs time, so figures are never taken from a traced batch.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

logger = logging.getLogger(__name__)
TRACE_DIR_ENV = "VLLM_OMNI_LIKE_TRACE_DIR"
TRACE_BATCHES_ENV = "VLLM_OMNI_LIKE_TRACE_BATCHES"  # comma-separated batch counts; default 2


class BatchTracer:
    """Counts one worker's batches and traces those the environment names."""

    def __init__(self, stage: str, rank: int) -> None:
        self.directory = os.environ.get(TRACE_DIR_ENV, "")
        wanted = os.environ.get(TRACE_BATCHES_ENV, "2")
        self.batches = {int(n) for n in wanted.split(",") if n.strip()}
        self.stage, self.rank, self.count = stage, rank, 0

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        self.count += 1
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
