"""`VLLM_OMNI_LIKE_TRACE_MEMORY` on CUDA (stages/trace.py): once the stage serves, a batch
that makes the caching allocator malloc on the device at least that often gets the allocator's
history written beside its timeline, naming the code behind each new segment; one that mallocs
nothing gets none, nor does a batch before the stage serves (a warm-up's).
Skipped where CUDA is absent (CI)."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from vllm_omni_like.stages.trace import TRACE_DIR_ENV, TRACE_MEMORY_ENV, BatchTracer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def grow_the_pool(blocks: list[torch.Tensor], n: int) -> None:
    """`n` tensors of 64 MiB each, kept: each a device malloc (above the allocator's cache)."""
    blocks.extend(torch.empty(16 * 2**20, device="cuda") for _ in range(n))


def test_a_batch_that_grows_the_pool_writes_the_allocators_history(tmp_path, monkeypatch):
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(TRACE_MEMORY_ENV, "4")
    tracer = BatchTracer("diffusion", 0, torch.device("cuda"))
    kept: list[torch.Tensor] = []
    try:
        with tracer.batch():  # a warm-up's batch: before `serving`, nothing is recorded
            grow_the_pool(kept, 4)
        tracer.serving()
        for mallocs in (4, 0, 2):  # batches 2..4
            with tracer.batch():
                grow_the_pool(kept, mallocs)
                tracer.mark("step")
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
        del kept
        torch.cuda.empty_cache()
    names = sorted(n for n in os.listdir(tmp_path) if n.endswith("-memory.pickle"))
    assert names == ["diffusion-rank0-batch2-memory.pickle"]  # batch 4's 2 mallocs are below 4
    with open(tmp_path / names[0], "rb") as f:
        snapshot = pickle.load(f)
    grown = [
        e for trace in snapshot["device_traces"] for e in trace if e["action"] == "segment_alloc"
    ]
    assert grown and any(
        frame["name"] == "grow_the_pool" for e in grown for frame in e.get("frames", [])
    )
