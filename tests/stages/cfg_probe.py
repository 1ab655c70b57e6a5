"""A diffusion stage for the CFG-parallel tests of our own loop, imported by 'module:Class' in its
workers (or made in the test's own process for the one-rank reference). It writes what a test
compares into the directory $CFG_PROBE_DIR: rank 0 each request's final latents, before the VAE
(`<request id>.pt`, float32: tests/stages/sequence_probe.py's), and every rank the rows of each
forward its denoisers ran (`rows-rank<r>.txt`, one count a line). And `local_branches`: a loaded
stage's loop split as CFG-parallel splits it, rank 1's side in the same process."""

from __future__ import annotations

import os
import types
from typing import Any

import torch

from tests.stages.sequence_probe import keep_latents
from vllm_omni_like.parallel.cfg_parallel import LoopBranches, ServedBranches
from vllm_omni_like.stages.diffusion.stage import DiffusionStage

PROBE_ENV = "CFG_PROBE_DIR"


class CfgProbeStage(DiffusionStage):
    def load(self, device: str) -> None:
        super().load(device)
        where = os.environ[PROBE_ENV]
        counts = os.path.join(where, f"rows-rank{self.ranks.rank}.txt")

        def count(module: Any, args: tuple, kwargs: dict) -> None:
            latents = args[0] if args else kwargs.get("hidden_states", kwargs.get("sample"))
            rows = len(latents) if isinstance(latents, list) else latents.shape[0]
            with open(counts, "a") as f:
                f.write(f"{rows}\n")

        for expert in self.runtime.adapter.experts():
            inner = getattr(expert.model, "_orig_mod", expert.model)  # (a compiled one's own)
            inner.register_forward_pre_hook(count, with_kwargs=True)
        if self.ranks.rank == 0:
            keep_latents(self.runtime, where)


class LocalLeader:
    """CFG-parallel's rank 0 side (`Leader`) with rank 1 in this process: its `ServedBranches`
    run each branch here; `calls` counts them."""

    link = types.SimpleNamespace(device=torch.device("cpu"))

    def __init__(self, served: ServedBranches) -> None:
        self.served, self.calls = served, 0
        self.statuses: list = []

    def alongside(self, local: Any, args: tuple, kwargs: dict) -> tuple:
        self.calls += 1
        return local(), self.served(*args, **kwargs)[0]

    def check(self) -> None:
        pass


def local_branches(stage: DiffusionStage) -> LocalLeader:
    """`stage`'s own loop (loaded with `batched_cfg` off, as CFG-parallel's rank 0 is) hands
    each step's unconditional forward to rank 1's side, here, on its own denoiser."""
    loop = stage.runtime.denoise
    leader = LocalLeader(ServedBranches(None, loop.run_denoiser))
    loop.branches = LoopBranches(leader)  # type: ignore[arg-type]  # (a Leader's stand-in)
    return leader
