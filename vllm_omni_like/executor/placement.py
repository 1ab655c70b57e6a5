"""Where a replica runs: its device, and the environment its worker sets for itself.

`--devices 0,1,2,3` (or `devices: [1, 2, 3]` for one stage in YAML) gives one replica per device
(`--replicas` more than the devices spreads them round-robin). A CUDA worker sets
`CUDA_VISIBLE_DEVICES` to its own GPU in its own process, first thing, before anything touches
CUDA, and then uses `cuda:0` — never in the server's environment, which the replicas' start
threads share. It also sets the NCCL variables a host needs for safe collectives where the host
has not set them: NVLink multicast (NVLS) off, and NCCL's cuMem allocator off (both hang or fail
on some drivers and in containers; vLLM turns the second off for the same reason).
"""

from __future__ import annotations

import logging
import os
import sys

from vllm_omni_like.config import StageConfig, cache_dir
from vllm_omni_like.wire import StartReport

logger = logging.getLogger("vllm_omni_like.worker")
NCCL_SAFE = {"NCCL_NVLS_ENABLE": "0", "NCCL_CUMEM_ENABLE": "0"}


def replica_device(devices: tuple[str, ...], default: str, index: int) -> str:
    """The device of replica `index`: its entry of `devices` (round-robin), else `default`."""
    return devices[index % len(devices)] if devices else default


def rank_devices(config: StageConfig, replica: int) -> tuple[str, ...]:
    """The device of each worker (rank) of replica `replica`. The N ranks of a CFG-parallel
    (N = 2) or sequence-parallel replica take consecutive entries of `devices` (replica r:
    Nr to Nr + N - 1); other ranks share their replica's device."""
    ranks = config.workers_per_replica
    if config.leads and config.devices:
        n = len(config.devices)
        return tuple(config.devices[(replica * ranks + k) % n] for k in range(ranks))
    return (replica_device(config.devices, config.device, replica),) * ranks


def replica_label(config: StageConfig, replica: int) -> str:
    """The device(s) of a replica as /health and /metrics show them: cuda:1 or cuda:0,cuda:1."""
    return ",".join(dict.fromkeys(rank_devices(config, replica)))


def gpu_index(device: str) -> int | None:
    """The host's GPU index of a device named `cuda:N` (None for any other device)."""
    if device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    return None


def pin(device: str, peers: tuple[str, ...] = ()) -> str:
    """In a worker process, before CUDA starts: see only this device's GPU (and those of the
    other ranks of its replica, after it, so NCCL can reach them directly); return the name
    the worker uses for its own from now on (`cuda:0`), or `device` itself when it names no
    one GPU."""
    index = gpu_index(device)
    if index is None:
        return device
    others = [i for i in (gpu_index(p) for p in peers) if i is not None and i != index]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in (index, *others))
    for key, value in NCCL_SAFE.items():
        os.environ.setdefault(key, value)
    return "cuda:0"


def share_compile_cache(directory: str = "") -> str:
    """Compiled kernels and graphs persist in one cache directory, shared by every replica and
    every restart, so a restarted compiled replica loads instead of compiling (inductor's FX
    graph cache and AOTAutograd's, Triton's kernels under it): `directory` (--compile-cache),
    else TORCHINDUCTOR_CACHE_DIR where the host set it, else under the server's cache dir.
    Returns the directory."""
    if directory:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(directory)
    else:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_dir(), "inductor"))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    if "torch" in sys.modules:  # (a forked worker: torch read its settings before these)
        import torch._functorch.config
        import torch._inductor.config

        torch._inductor.config.fx_graph_cache = True
        torch._functorch.config.enable_autograd_cache = True
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


def start_report(
    compiled: bool, seconds: float, graphs: tuple[tuple[str, ...], int]
) -> StartReport:
    """A worker's start: how long it took and, compiled, what its compile cache held (graphs
    loaded from it, graphs compiled anew: torch's counters of this process) and its CUDA
    graphs (their buckets, their pool's bytes)."""
    if not compiled:
        return StartReport(seconds)
    from torch._dynamo.utils import counters  # (only a compiled stage has torch)

    from vllm_omni_like.stages.diffusion.precompiled import COUNTS

    inductor = counters["inductor"]
    hits, misses = inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"]
    traced = counters["stats"]["unique_graphs"]
    where = os.environ.get("TORCHINDUCTOR_CACHE_DIR", "")
    logger.info(
        "started in %.1fs: %d compiled graphs loaded from the compile cache %s, %d compiled; "
        "%d forwards loaded precompiled (no trace), %d graphs traced",
        seconds,
        hits,
        where,
        misses,
        COUNTS.loaded,
        traced,
    )
    return StartReport(seconds, where, hits, misses, *graphs, COUNTS.loaded, traced)


def limit_memory(device: str, fraction: float | None) -> None:
    """Cap this process's share of its GPU's memory, so stages sharing a GPU do not starve
    each other's allocators (`gpu_memory_fraction` of a stage)."""
    if fraction is None or device == "cpu":
        return
    import torch

    if device == "auto":
        if not torch.cuda.is_available():
            return
        device = "cuda"
    where = torch.device(device)
    if where.index is None:  # torch wants an index: the device this worker uses
        where = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_per_process_memory_fraction(fraction, where)


def gpu_memory_in_use() -> int:
    """Bytes the CUDA caching allocator holds in this process (0 where CUDA never started; this
    never starts it, nor imports torch)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0
    return int(torch.cuda.memory_reserved())
