"""Run a function on N gloo ranks (NCCL's, on GPUs), each a spawned process of its own, with every
wait bounded: what each rank's function returns, in rank order (a rank that raises fails the
test with its traceback; one that does not answer in time is killed and fails it)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any


def _rank_main(
    target: Callable[..., Any], rank: int, size: int, store: str, out, args, backend: str
) -> None:
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)  # N ranks on a 2-core machine: each spins on one
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{store}",
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=60),
        )
        out.put((rank, True, target(rank, size, *args)))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    target: Callable[..., Any],
    size: int,
    *args: Any,
    timeout: float = 90.0,
    backend: str = "gloo",
) -> list:
    """`target(rank, size, *args)` on `size` ranks (a module-level function: spawned)."""
    ctx = mp.get_context("spawn")
    root = tempfile.mkdtemp(prefix="gloo-ranks-")
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(target, r, size, os.path.join(root, "store"), out, args, backend),
        )
        for r in range(size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < size:
            try:
                rank, ok, value = out.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"ranks {sorted(set(range(size)) - set(results))} did "
                    f"not answer within {timeout:g}s"
                ) from None
            assert ok, f"rank {rank} failed:\n{value}"
            results[rank] = value
    finally:
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
        shutil.rmtree(root, ignore_errors=True)
    assert [p.exitcode for p in procs] == [0] * size
    return [results[r] for r in range(size)]


def diffusers_ulysses(model: Any, size: int, plan: Any = None) -> None:
    """diffusers' own context parallelism (Ulysses over `size` ranks) on `model` (by its own
    plan, or `plan`), in a rank of `run_ranks`: the independent reference of our split. On the
    CPU: diffusers picks a rank's device as its rank modulo the accelerators' count, 0 on a
    host without one, so this rank's process is told of one (it uses the CPU all the same:
    gloo, a CPU mesh)."""
    import torch
    from diffusers.models._modeling_parallel import ContextParallelConfig

    torch.accelerator.device_count = lambda: 1  # (this process's own: a spawned rank)
    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=size), cp_plan=plan)
