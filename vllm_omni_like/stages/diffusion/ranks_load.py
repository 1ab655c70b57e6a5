"""The load's steps for a replica of several ranks (load.py calls them in its order): meeting the
other ranks, CFG-parallel's branches (rank 0's own loop hands each step's unconditional forward
to rank 1; a pipeline's call has its denoiser split) and sequence parallelism's forwards (rank
0's denoisers hand each forward to every rank, each splitting the tokens)."""

from __future__ import annotations

import logging
from typing import Any

import torch

from vllm_omni_like.config import StageConfig
from vllm_omni_like.models.adapter import Adapter
from vllm_omni_like.models.family import Loop
from vllm_omni_like.parallel import cfg_parallel
from vllm_omni_like.parallel.branches import BatchedCFG
from vllm_omni_like.parallel.patch_decode import Bands
from vllm_omni_like.parallel.rank_link import Link
from vllm_omni_like.parallel.ranks import Ranks
from vllm_omni_like.parallel.sequence_parallel import (
    SequenceFollower,
    SequenceLeader,
    SequenceParallelCall,
    SequenceParallelDenoiser,
    heads_note,
)
from vllm_omni_like.parallel.ulysses import SequenceShards
from vllm_omni_like.stages.diffusion.lora_pool import LoraPool
from vllm_omni_like.stages.diffusion.runtime import CfgRanks, SequenceRanks
from vllm_omni_like.stages.diffusion.step import DenoiseLoop
from vllm_omni_like.stages.trace import BatchTracer
from vllm_omni_like.wire import Mode

# the stage's logger: what the load says comes from the stage, under the name it always had
logger = logging.getLogger("vllm_omni_like.stages.diffusion.stage")

CfgWrapper = BatchedCFG | cfg_parallel.SplitCFG  # a denoiser wrapped to run both branches


def connect_ranks(config: StageConfig, ranks: Ranks, device: torch.device) -> Link | None:
    """CFG-parallel, sequence parallelism: meet the other ranks first (they load meanwhile);
    the process group's timeout is a backstop behind the executor's death and stall
    detection."""
    if not config.leads:
        return None
    backstop = (
        max(config.load_timeout, config.compile_timeout, config.cold_timeout) + config.stall_timeout
    )
    return Link(ranks, device, backstop, collectives=config.sequence_parallel > 1)


def split_sequence(config: StageConfig, ranks: Ranks, link: Link | None, adapter: Adapter) -> None:
    """Sequence parallelism: the family's split of its denoisers' tokens over the ranks."""
    if link is None or config.sequence_parallel == 1:
        return
    shards = SequenceShards(link.rank - link.leader, link.sequence, link.group)
    heads = adapter.split_sequence(shards)
    if (note := heads_note(heads, link.sequence)) is not None:
        logger.warning("stage %s: %s", config.name, note)


def sequence_ranks(
    config: StageConfig,
    ranks: Ranks,
    link: Link | None,
    pipe: Any,
    adapter: Adapter,
    loras: LoraPool | None = None,
) -> SequenceRanks | None:
    """A group's leader's denoisers (and rank 0's patch-parallel VAE decode) hand each call to
    the group's other ranks, which keep only those models (compiled or not) and serve them; the
    LoRA pool's slots and each forward's rows go with them (every rank holds the pool).
    The leaders: rank 0, and with CFG-parallel the unconditional branch's group's (rank 1's
    side of CFG-parallel, which leads its group's forwards as rank 0 leads its own)."""
    if link is None or config.sequence_parallel == 1:
        return None
    models: dict[str, Any] = {expert.name: expert.model for expert in adapter.experts()}
    vae = None
    if link.leader == 0:  # (the unconditional branch's group decodes nothing)
        vae = adapter.split_decode(Bands(link.rank, link.sequence, link.group))
    if vae is not None:
        models[f"{vae}.decode"] = getattr(pipe, vae).decode
    if link.rank != link.leader:
        cfg_parallel.keep_only(pipe, adapter.keep_for_branches() | ({vae} if vae else set()))
        return SequenceRanks(link, None, SequenceFollower(link, loras), models)
    leader = SequenceLeader(link, loras)
    for name, model in models.items():
        owner, _, method = name.partition(".")
        if method:  # (a component's method: its decode)
            setattr(getattr(pipe, owner), method, SequenceParallelCall(model, name, leader))
        else:
            setattr(pipe, name, SequenceParallelDenoiser(model, name, leader))
    return SequenceRanks(link, leader, None, models)


def guidance(
    config: StageConfig,
    ranks: Ranks,
    link: Link | None,
    tracer: BatchTracer,
    adapter: Adapter,
    denoise: DenoiseLoop,
    loops: dict[Mode, tuple[Loop, str | None]],
) -> tuple[CfgWrapper | None, CfgRanks | None]:
    """The denoiser's CFG wrapper (both branches in one forward of a pipeline that calls it
    twice; or split over the ranks where a mode runs the pipeline's call), and this rank's side
    of the CFG-parallel ranks: rank 0's own loop hands each step's unconditional forward to
    rank 1, which keeps only what its denoiser needs and serves them (each forward with its
    LoRA rows; each LoRA slot rank 0 writes copied to it). `loops`: the loop each of the
    model's modes runs (registry's `loops_for`, its generation's first)."""
    pipe, first = adapter.pipe, next(iter(loops))
    pipeline_modes = {mode for mode, (loop, _) in loops.items() if loop == "pipeline"}
    if link is None or not config.cfg_parallel:
        batched = config.batched_cfg and first in pipeline_modes
        return (adapter.batched_cfg() if batched else None), None
    if link.rank != link.leader:  # (a sequence-parallel group's other rank: its leader's)
        return None, None
    denoiser = getattr(pipe, adapter.denoiser_name)  # rank 1's, compiled or not
    pool = denoise.loras  # (both ranks hold it: rank 0's slots go to rank 1 as it writes them)
    if ranks.rank > 0:
        cfg_parallel.keep_only(pipe, adapter.keep_for_branches())
        served = cfg_parallel.ServedBranches(denoiser, denoise.run_denoiser)
        return None, CfgRanks(link, None, cfg_parallel.Follower(link, pool), served)
    leader = cfg_parallel.Leader(link, tracer.mark, pool)
    denoise.branches = cfg_parallel.LoopBranches(leader)
    split = _split_pipeline_call(config.name, adapter, leader, pipeline_modes, set(loops))
    return split, CfgRanks(link, leader, None, denoiser)


def _split_pipeline_call(
    name: str, adapter: Adapter, leader: cfg_parallel.Leader, modes: set[Mode], every: set[Mode]
) -> CfgWrapper | None:
    """CFG-parallel where a mode runs the pipeline's call (the generic family): its denoiser
    wrapped so the branches run on both ranks; a family that has our own loop too and no such
    split runs those modes on rank 0 alone."""
    if not modes:
        return None
    try:
        return adapter.split_cfg(leader)
    except ValueError as exc:
        if every == modes:  # (nothing would run on two ranks)
            raise
        logger.warning("stage %s: %s run on rank 0 alone: %s", name, sorted(modes), exc)
        return None
