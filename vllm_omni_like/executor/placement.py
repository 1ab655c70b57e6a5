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

import os
import sys

from vllm_omni_like.config import cache_dir

NCCL_SAFE = {"NCCL_NVLS_ENABLE": "0", "NCCL_CUMEM_ENABLE": "0"}


def replica_device(devices: tuple[str, ...], default: str, index: int) -> str:
    """The device of replica `index`: its entry of `devices` (round-robin), else `default`."""
    return devices[index % len(devices)] if devices else default


def gpu_index(device: str) -> int | None:
    """The host's GPU index of a device named `cuda:N` (None for any other device)."""
    if device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    return None


def pin(device: str) -> str:
    """In a worker process, before CUDA starts: see only this device's GPU; return the name the
    worker uses for it from now on (`cuda:0`), or `device` itself when it names no one GPU."""
    index = gpu_index(device)
    if index is None:
        return device
    os.environ["CUDA_VISIBLE_DEVICES"] = str(index)
    for key, value in NCCL_SAFE.items():
        os.environ.setdefault(key, value)
    return "cuda:0"


def share_compile_cache() -> None:
    """Compiled kernels and graphs persist in one cache under the server's cache dir, shared by
    every replica and every restart, so a restarted compiled replica loads instead of compiling
    (`TORCHINDUCTOR_CACHE_DIR`, unless the host set its own)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_dir(), "inductor"))
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")


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

    torch.cuda.set_per_process_memory_fraction(fraction, torch.device(device))


def gpu_memory_in_use() -> int:
    """Bytes the CUDA caching allocator holds in this process (0 where CUDA never started; this
    never starts it, nor imports torch)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0
    return int(torch.cuda.memory_reserved())
