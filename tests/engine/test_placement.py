"""Replicas placed on devices (executor/placement.py): a replica per device, each worker pinned to
its own GPU in its own process, per-replica health, and a death that stays on its device."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import time

import pytest

from tests.conftest import wait_for
from tests.engine.helpers import engine, final, req
from vllm_omni_like import flags
from vllm_omni_like.config import StageConfig
from vllm_omni_like.errors import ConfigError
from vllm_omni_like.executor import placement
from vllm_omni_like.pipelines.catalog import from_yaml


def test_devices_give_one_replica_each_and_name_gpus_or_the_cpu():
    stage = StageConfig(name="d", kind="null", devices=[1, "2", "cuda:3", "cpu"])
    assert stage.devices == ("cuda:1", "cuda:2", "cuda:3", "cpu") and stage.replicas == 4
    spread = StageConfig(name="d", kind="null", devices=(0, 1), replicas=4)  # round-robin
    assert [placement.replica_device(spread.devices, "auto", i) for i in range(4)] == [
        "cuda:0",
        "cuda:1",
        "cuda:0",
        "cuda:1",
    ]
    assert placement.replica_device((), "cpu", 3) == "cpu"
    with pytest.raises(ConfigError, match="devices entry 'gpu0'"):
        StageConfig(name="d", kind="null", devices=("gpu0",))
    with pytest.raises(ConfigError, match="gpu_memory_fraction"):
        StageConfig(name="d", kind="null", gpu_memory_fraction=1.5)


def test_the_flags_and_a_yaml_stage_place_replicas(tmp_path):
    parser = argparse.ArgumentParser()
    flags.add_engine_args(parser)
    args = parser.parse_args(["--devices", "0,1,2", "--gpu-memory-fraction", "0.45"])
    assert flags.stage_overrides(args) == {"devices": ("0", "1", "2"), "gpu_memory_fraction": 0.45}
    spec = tmp_path / "p.yaml"
    spec.write_text(
        "pipelines:\n"
        "  - name: split\n"
        "    output: image\n"
        "    stages:\n"
        "      - {name: llm, kind: 'null', devices: [0], options: {output: text}}\n"
        "      - {name: diffusion, kind: 'null', devices: [1, 2, 3], gpu_memory_fraction: 0.9}\n"
    )
    llm, diffusion = from_yaml(str(spec))[0].stages
    assert (llm.devices, llm.replicas) == (("cuda:0",), 1)
    assert (diffusion.devices, diffusion.replicas) == (("cuda:1", "cuda:2", "cuda:3"), 3)
    assert diffusion.gpu_memory_fraction == 0.9


def test_the_split_gpus_example_places_the_llm_and_the_diffusion_apart():
    (pipeline,) = from_yaml("examples/split_gpus.yaml")
    llm, diffusion = pipeline.stages
    assert (llm.devices, llm.replicas, llm.gpu_memory_fraction) == (("cuda:0",), 1, 0.2)
    assert (diffusion.devices, diffusion.replicas) == (("cuda:1", "cuda:2", "cuda:3"), 3)


def test_pin_sets_the_gpu_and_nccl_safety_in_this_process_only(monkeypatch):
    for key in ("CUDA_VISIBLE_DEVICES", *placement.NCCL_SAFE):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NCCL_CUMEM_ENABLE", "1")  # the host's own choice is kept
    assert placement.pin("cpu") == "cpu" and "CUDA_VISIBLE_DEVICES" not in os.environ
    assert placement.pin("cuda:3") == "cuda:0"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"
    assert os.environ["NCCL_NVLS_ENABLE"] == "0" and os.environ["NCCL_CUMEM_ENABLE"] == "1"


def test_each_worker_pins_its_own_gpu_and_the_server_environment_stays_as_it_was():
    """Null stages never touch CUDA, so GPU placement runs here on the CPU: each replica's
    worker sees only its GPU; the parent (whose threads start replicas side by side) never."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    with engine("null-image", stage_kw={"devices": ("cuda:3", "cuda:5")}) as eng:
        pool = eng.orchestrator.pools["null-image"][0]
        assert [r.executor.visible_devices for r in pool.replicas] == ["3", "5"]
        assert os.environ.get("CUDA_VISIBLE_DEVICES") == before
        stage = eng.health()[0]
        assert [(r["index"], r["device"], r["state"]) for r in stage["replicas"]] == [
            (0, "cuda:3", "ready"),
            (1, "cuda:5", "ready"),
        ]
        assert all(r["gpu_memory_bytes"] == 0 and len(r["pids"]) == 1 for r in stage["replicas"])


def test_a_killed_replica_stays_on_its_device_the_others_keep_serving():
    """Two replicas on two devices; clients keep both busy; replica 0's worker is SIGKILLed.
    Completions never pause longer than 1.5 x a batch's time, the dead replica's requests are
    re-routed and succeed, and it restarts on its own device."""
    kw = {"devices": ("cpu", "cpu"), "max_batch_size": 1, "batch_wait": 0.0}
    step = 0.04  # 4 steps: a batch of 0.16 s
    with engine("null-image", stage_kw=kw) as eng:
        pool = eng.orchestrator.pools["null-image"][0]
        done: list[float] = []
        killed: list[int] = []

        async def client(k: int) -> None:
            for i in range(12):
                out = await final(
                    eng, req(f"c{k}-{i}", pipeline="null-image", steps=4, delay=step, seed=i)
                )
                assert out.ok, out.error
                done.append(time.monotonic())

        async def chaos() -> None:
            while len(done) < 6:
                await asyncio.sleep(0.01)
            pid = pool.replicas[0].executor.pids[0]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

        async def main() -> None:
            await asyncio.gather(*(client(k) for k in range(4)), chaos())

        asyncio.run(main())
        wait_for(lambda: pool.replicas[0].live, 30, "replica 0 restarted")
        assert pool.replicas[0].executor.pids[0] != killed[0]
        assert pool.replicas[0].device == "cpu" and eng.stats.snapshot()["worker_deaths"] == 1
    gaps = [b - a for a, b in itertools.pairwise(done)]
    assert len(done) == 48 and max(gaps) <= 1.5 * 4 * step, max(gaps)
