"""bench/lora_kernels.py's smoke run on the CPU (the GPU run's code, tiny shapes): every case
checks its kernels against the gather and times them, and the file says what the rule picked
and which was fastest."""

from __future__ import annotations

import json

import pytest

from tests.bench.bench_run import run_bench


@pytest.mark.drill  # (a subprocess importing torch: ~7 s on this CPU)
@pytest.mark.timeout(120)
def test_the_lora_kernels_bench_smoke_writes_each_case(tmp_path):
    run_bench("lora_kernels.py", ["--smoke", "--out-dir", str(tmp_path)], timeout=100)
    data = json.loads((tmp_path / "lora_kernels-cpu.json").read_text())
    assert data["device"] == "cpu" and data["dtype"] == "fp32"
    assert len(data["results"]) == data["summary"]["cases"] == 6
    for entry in data["results"]:
        for kernel in ("gather", "pooled", "grouped_mm"):  # (torch's CPU grouped GEMM: fp32)
            assert entry[f"{kernel}_rel_err"] <= 1e-4 and entry[f"{kernel}_ms"] > 0, entry
        assert entry["rule"] == "pooled" and entry["fastest"] in ("gather", "pooled", "grouped_mm")
