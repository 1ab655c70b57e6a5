"""stages/trace.py: the batches VLLM_OMNI_LIKE_TRACE_BATCHES names are traced, no others; every
batch that ends gets its timeline."""

from __future__ import annotations

import gzip
import json
import time

import pytest
import torch

from vllm_omni_like.stages.trace import TRACE_BATCHES_ENV, TRACE_DIR_ENV, BatchTracer


def test_only_the_named_batches_are_traced(tmp_path, monkeypatch):
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path / "traces"))
    monkeypatch.setenv(TRACE_BATCHES_ENV, "2,4")
    tracer = BatchTracer("diffusion", rank=1)
    x = torch.ones(64, 64)
    for _ in range(4):
        with tracer.batch():
            x = x @ x / 64
    names = sorted(p.name for p in (tmp_path / "traces").iterdir())
    assert names == [
        "diffusion-rank1-batch2.json.gz",
        "diffusion-rank1-batch4.json.gz",
        "diffusion-rank1-timeline.jsonl",  # every batch's line
    ]
    with gzip.open(tmp_path / "traces" / names[0]) as f:
        events = json.loads(f.read())["traceEvents"]
    assert any("mm" in str(e.get("name", "")) for e in events)  # the batch's matmul is in it


def test_off_without_a_directory(tmp_path, monkeypatch):
    monkeypatch.delenv(TRACE_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    tracer = BatchTracer("diffusion", rank=0)
    for _ in range(3):
        with tracer.batch():
            torch.ones(4).sum()
    assert tracer.count == 3 and list(tmp_path.iterdir()) == []


def test_every_batch_gets_its_timeline_and_a_failed_one_none(tmp_path, monkeypatch):
    monkeypatch.setenv(TRACE_DIR_ENV, str(tmp_path))
    monkeypatch.setenv(TRACE_BATCHES_ENV, "")  # no profiler: the timelines alone
    tracer = BatchTracer("diffusion", rank=0, device=torch.device("cpu"))
    for steps in (3, 2):
        with tracer.batch():
            for _ in range(steps):
                time.sleep(0.01)
                tracer.mark("step")
    with pytest.raises(RuntimeError), tracer.batch():
        raise RuntimeError("the batch failed")
    assert [p.name for p in tmp_path.iterdir()] == ["diffusion-rank0-timeline.jsonl"]
    text = (tmp_path / "diffusion-rank0-timeline.jsonl").read_text()
    lines = [json.loads(x) for x in text.splitlines()]
    assert [line["batch"] for line in lines] == [1, 2]
    assert [line["labels"] for line in lines] == [
        ["begin"] + ["step"] * 3,
        ["begin", "step", "step"],
    ]
    for line in lines:
        gaps = [b - a for a, b in zip(line["ms"], line["ms"][1:], strict=False)]
        assert line["ms"][0] == 0 and all(g >= 9.5 for g in gaps)  # each step slept 10 ms
        assert line["ms"] == line["host_ms"]  # on the CPU, one clock
    assert 0 < lines[1]["t0"] - lines[0]["t0"] < 5
