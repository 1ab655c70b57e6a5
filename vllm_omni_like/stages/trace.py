"""Where a step's time goes: torch.profiler traces of chosen batches, and every batch's timeline.

    VLLM_OMNI_LIKE_TRACE_DIR=/tmp/traces VLLM_OMNI_LIKE_TRACE_BATCHES=2 vllm-omni-like serve ...

Each worker traces its own `n`-th batches (counted per worker from 1: rank 0's denoising loops,
a CFG-parallel rank 1's served branches) and writes `<dir>/<stage>-rank<r>-batch<n>.json.gz`
(Chrome trace format: chrome://tracing or https://ui.perfetto.dev). A trace costs time, so
figures are never taken from a traced batch (`VLLM_OMNI_LIKE_TRACE_BATCHES=` traces none).

Every batch also gets one line in `<dir>/<stage>-rank<r>-timeline.jsonl`: at the batch's begin
and at each mark the stage set (rank 0: each step's end, the wait for the device after
the last; rank 1: each branch's start and end), the device's clock (`ms`, one CUDA
event each, read once the batch ended) and the host's (`host_ms`), both from the begin, whose
time on the machine's monotonic clock is `t0` (the same clock in every process: the ranks'
timelines line up); a running set's step marks also say how many requests that step ran
(`rows`); on CUDA, `alloc` counts what the caching allocator did meanwhile (its retries after
freeing its cache, its device mallocs and frees: each a device-wide wait). What a step takes
on the device without the profiler's overhead, and how far the host runs ahead of it. Off
unless the directory is set.
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
TRACE_MEMORY_ENV = "VLLM_OMNI_LIKE_TRACE_MEMORY"  # snapshots of batches that grew the pool
MEMORY_SNAPSHOTS = 3
ALLOC_COUNTERS = (  # the caching allocator's device-wide waits (timeline "alloc")
    "num_alloc_retries",
    "num_sync_all_streams",
    "num_device_alloc",
    "num_device_free",
)


class BatchTracer:
    """Counts one worker's batches and traces those the environment names."""

    def __init__(self, stage: str, rank: int, device: Any = None) -> None:
        self.directory = os.environ.get(TRACE_DIR_ENV, "")
        wanted = os.environ.get(TRACE_BATCHES_ENV, "2")
        self.batches = {int(n) for n in wanted.split(",") if n.strip()}
        self.stage, self.rank, self.count = stage, rank, 0
        self.device = device  # a CUDA device: the marks go on its current stream
        self._marks: list[tuple[str, Any, float]] = []
        self._rows: list[int | None] = []  # the rows each mark's step ran, where it says
        self.sharing = 0  # running-set lanes in the shared batch (`open_shared`)
        self._shared: contextlib.ExitStack | None = None
        self._alloc: dict[str, int] = {}  # the allocator's counters at the batch's begin
        self.memory_mallocs = int(os.environ.get(TRACE_MEMORY_ENV, "0") or 0)
        self.memory_snapshots = 0  # (set once the stage serves: `serving`)

    def serving(self) -> None:
        """The stage is loaded and warmed up: from now on, with `TRACE_MEMORY_ENV`, the
        allocator records its history (python stacks for every allocation: a compile warm-up
        under it took minutes longer on an H100, and its batches are not the ones looked for)."""
        if self.directory and self.memory_mallocs > 0 and self._on_cuda():
            import torch

            self.memory_snapshots = MEMORY_SNAPSHOTS
            torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")

    def _on_cuda(self) -> bool:
        import torch

        return self.device is not None and torch.device(self.device).type == "cuda"

    def open_shared(self) -> None:
        """A running set's lane opens: the first one opens a batch of the timeline that the
        lanes share, until the last of them closes it (`close_shared`)."""
        self.sharing += 1
        if self.sharing == 1:
            self._shared = contextlib.ExitStack()
            self._shared.enter_context(self.batch())

    def close_shared(self, failure: BaseException | None = None) -> None:
        self.sharing -= 1
        if self.sharing or self._shared is None:
            return
        shared, self._shared = self._shared, None
        if failure is not None:
            shared.__exit__(type(failure), failure, failure.__traceback__)
        else:
            shared.close()

    def mark(self, label: str, rows: int | None = None) -> None:
        """A point of this batch's timeline, on the device's clock (no wait for the device);
        `rows`: the rows the step that ends here ran (a running set's change step by step)."""
        if not self.directory:
            return
        self._rows.append(rows)
        import torch

        if self._on_cuda():
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self._marks.append((label, event, time.monotonic()))
        else:
            self._marks.append((label, None, time.monotonic()))

    def _write_timeline(self) -> None:
        marks, self._marks = self._marks, []
        rows, self._rows = self._rows, []
        if not marks:
            return
        _, first, t0 = marks[0]
        host = [round(1000 * (t - t0), 3) for _, _, t in marks]
        if first is None:  # the CPU: the host's clock is the device's
            at = host
        else:
            marks[-1][1].synchronize()
            at = [round(first.elapsed_time(e), 3) for _, e, _ in marks]
        line = {
            "batch": self.count,
            "t0": t0,
            "labels": [m[0] for m in marks],
            "ms": at,
            "host_ms": host,
        }
        if any(r is not None for r in rows):
            line["rows"] = rows
        if self.count in self.batches:  # (its steps ran under the profiler: not figures)
            line["traced"] = True
        if first is not None:
            now = self._alloc_counts()
            grew = {k: now[k] - self._alloc.get(k, 0) for k in now}
            line["alloc"] = grew
            if grew["num_device_alloc"] >= max(self.memory_mallocs, 1):
                self._dump_memory()
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, f"{self.stage}-rank{self.rank}-timeline.jsonl")
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        self.count += 1
        self._marks, self._rows = [], []
        self.mark("begin")
        if self.directory and self._marks[-1][1] is not None:
            self._alloc = self._alloc_counts()
        with self._profiled():
            yield
        if self.directory:  # (not after a failure: its device may be gone)
            self._write_timeline()

    def _alloc_counts(self) -> dict[str, int]:
        import torch

        stats = torch.cuda.memory_stats(self.device)
        return {k: int(stats.get(k, 0)) for k in ALLOC_COUNTERS}

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

    def _dump_memory(self) -> None:
        """The allocator's history up to this batch's end (`TRACE_MEMORY_ENV`), while any of
        the snapshots it allows are left."""
        if self.memory_snapshots <= 0:
            return
        import torch

        self.memory_snapshots -= 1
        name = f"{self.stage}-rank{self.rank}-batch{self.count}-memory.pickle"
        os.makedirs(self.directory, exist_ok=True)
        torch.cuda.memory._dump_snapshot(os.path.join(self.directory, name))
        logger.info(
            "stage %s rank %d: the allocator's history to batch %d: %s",
            self.stage,
            self.rank,
            self.count,
            name,
        )
