"""bench/caching.py runs end to end on the CPU with the tiny Wan model (the GPU run's code
path, shapes small): every key the issue asks for is written."""

from __future__ import annotations

import json

import pytest

from tests.bench.bench_run import run_bench


@pytest.mark.drill  # (about 15 tiny runs: ~12 s on this CPU; the suite is over its 12 minutes)
@pytest.mark.timeout(600)
def test_the_caching_bench_writes_the_issues_keys(tmp_path):
    out = tmp_path / "caching-cpu.json"
    args = ["--tiny", "--device", "cpu", "--concurrency", "2", "--repeats", "1", "--steps", "4"]
    run_bench("caching.py", [*args, "--out", str(out)], timeout=550)
    result = json.loads(out.read_text())["models"]["tiny-video"]
    for key in ("skipped_share", "speedup_b1", "speedup_batched", "diffusers_fbcache_speedup_b1"):
        assert key in result
    assert "tiny_block_evals_saved_at_accuracy" in result
    assert 0.2 < result["skipped_share"] < 0.5  # (about half the rest, the first step's aside)
    assert set(result["speedup_batched"]) == {"c2"}
    for figure in (result["speedup_b1"], result["speedup_batched"]["c2"]):
        assert figure["denoise"] > 0 and figure["e2e"] > 0
    assert result["speedup_b1"]["lagged"]["e2e"] > 0  # (the sync read's cost, at batch 1)
    assert result["diffusers_fbcache_speedup_b1"]["e2e"] > 0
