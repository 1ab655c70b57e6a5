"""How the multi-process executor starts a worker process.

- A worker that may use CUDA **spawns**: a fresh interpreter, which pins its GPU
  (`CUDA_VISIBLE_DEVICES`) before anything touches CUDA; CUDA cannot be inherited over a fork.
- A worker of a torch stage on a host without a GPU (device `cpu`, or `auto` where the host has
  no NVIDIA device) **forks from multiprocessing's fork server**: one process per engine that
  imported torch, diffusers, transformers and the stages once (`PRELOAD`), so a worker start or
  restart skips those imports (seconds on a small host). Its workers watch the engine's pid,
  not their parent's (the fork server: executor/worker.py `watch_parent`), and take the
  engine's environment at their start, as a spawned worker does (the fork server's is the one
  of its own start). The fork server exits once the engine and its workers are gone.
- A stage of kind `null` imports no torch: it spawns (half a second), so a server of null
  stages never starts the fork server.

`VLLM_OMNI_LIKE_WORKER_START=spawn` (or `forkserver`) overrides the choice for every worker.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing.context import ForkServerContext, SpawnContext

from vllm_omni_like.config import StageConfig

START_ENV = "VLLM_OMNI_LIKE_WORKER_START"
METHODS = ("spawn", "forkserver")
PRELOAD = (
    "torch",
    "diffusers",
    "transformers",
    "vllm_omni_like.executor.worker",
    "vllm_omni_like.stages.diffusion.stage",
    "vllm_omni_like.stages.llm.stage",
)
# where a Linux host shows its NVIDIA GPUs (the driver's, and the devices a container is given)
GPU_MARKS = ("/proc/driver/nvidia/gpus", "/dev/nvidia0", "/dev/nvidiactl")


def host_has_gpu() -> bool:
    """Whether this host shows an NVIDIA GPU, without importing torch or starting CUDA."""
    return any(os.path.exists(mark) for mark in GPU_MARKS)


def method_for(config: StageConfig, devices: tuple[str, ...]) -> str:
    """ "spawn" or "forkserver" for the workers of a replica on `devices`."""
    chosen = os.environ.get(START_ENV, "")
    if chosen:
        if chosen not in METHODS:
            raise ValueError(f"{START_ENV}={chosen!r}: expected one of {', '.join(METHODS)}")
        return chosen
    if config.kind == "null" or not hasattr(os, "pidfd_open"):
        return "spawn"
    on_cpu = all(d == "cpu" or (d == "auto" and not host_has_gpu()) for d in devices)
    return "forkserver" if on_cpu else "spawn"


def context(method: str) -> SpawnContext | ForkServerContext:
    """The multiprocessing context of `method` (the fork server's preload set before it starts:
    it starts at its first worker and serves every later one of this process)."""
    if method != "forkserver":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx
