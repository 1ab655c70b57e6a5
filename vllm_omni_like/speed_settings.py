"""The diffusion stages' speed settings refused at start-up, torch-free: FP8, the step cache
(`--cache`, `--cache-threshold`, `--cache-decision`: what they may be; what /health says of
them), `--offload` (what it runs beside) and `--attention fp8` (not sequence-parallel).
stages/diffusion/block_cache.py is the cache itself, stages/diffusion/offload.py the offload."""

from __future__ import annotations

from typing import Any

from vllm_omni_like.errors import ConfigError

CACHE_MODES = ("none", "first-block")
# sync: a row's decision from this step's first block (one device-to-host read a step);
# lagged: from its step before's, read without waiting for the device
CACHE_DECISIONS = ("sync", "lagged")
# the relative change of a row's first-block residual under which it reuses the other blocks',
# by decision where the stage and the request name none: the largest thresholds that kept
# every checker accuracy within 1 point of the uncached and the median PSNR >= 30 dB over 500
# paired seeded clips of the trained tiny-video on an NVIDIA H100 (bench/cache_quality.py,
# bench/results/cache_quality-h100.json: sync 0.05 saved 12.9% of block evaluations at 54.8
# dB, its 0.10 lost 1.6 points of colour; lagged 0.10 saved 28.6% at 41.5 dB)
DEFAULT_THRESHOLDS = {"sync": 0.05, "lagged": 0.10}
# idle-expert: a two-expert model's expert not in use waits in pinned host memory
OFFLOAD_MODES = ("none", "idle-expert")


def check_speed(config: Any) -> None:
    """Refuse what the stage `config` (a StageConfig) cannot run: FP8 or a step cache outside
    a diffusion stage; a cache of a kind, threshold or decision not known, or beside what it
    does not run with; FP8 attention under sequence parallelism (its processors replace the
    FP8-routed ones)."""
    diffusion = config.kind == "diffusion" or ":" in config.kind  # (or the user's own Stage)
    where = f"stage {config.name!r}"
    if config.quantization != "none" and not diffusion:
        raise ConfigError(
            f"{where}: --quantization {config.quantization} runs diffusion stages only, "
            f"not {config.kind!r}"
        )
    for flag, value, allowed in (
        ("cache", config.cache, CACHE_MODES),
        ("cache_decision", config.cache_decision, CACHE_DECISIONS),
    ):
        if value not in allowed:
            raise ConfigError(f"{where}: {flag} must be one of {', '.join(allowed)}, not {value!r}")
    if config.cache != "none":
        _check_cache(config, f"{where}: --cache {config.cache}", diffusion)
    _check_offload(config, where, diffusion)
    if config.attention == "fp8" and config.sequence_parallel > 1:
        raise ConfigError(
            f"{where}: --attention fp8: not with --sequence-parallel {config.sequence_parallel} "
            "(a sequence-parallel rank's attention is its family's Ulysses processor, which "
            "calls PyTorch SDPA: no FP8 attention would run); use --attention sdpa with it"
        )


def _check_cache(config: Any, where: str, diffusion: bool) -> None:
    if not diffusion:
        raise ConfigError(f"{where} runs diffusion stages only, not {config.kind!r}")
    if config.cache_threshold is not None and not config.cache_threshold >= 0.0:
        raise ConfigError(f"{where}: --cache-threshold must be >= 0, not {config.cache_threshold}")
    if config.cfg_parallel or config.sequence_parallel > 1:
        raise ConfigError(
            f"{where}: not with --cfg-parallel or --sequence-parallel yet (a CFG-parallel rank 1 "
            "would need its unconditional rows' caches; a sequence's shares would each "
            "measure a change of their own)"
        )
    if config.cuda_graphs == "on" or config.loras or config.lora_dir:
        raise ConfigError(
            f"{where}: not with --cuda-graphs on (a replayed graph runs every block of every "
            "row: a row's decision runs between them) nor with LoRA adapters yet (a sub-batch "
            "would need its rows' adapters gathered with them)"
        )
    if config.compile and config.regional_compile == "off":
        raise ConfigError(
            f"{where} compiles the denoiser block by block (each row's decision runs between "
            "its blocks): not with --regional-compile off"
        )


def _check_offload(config: Any, where: str, diffusion: bool) -> None:
    """`--offload`: a known mode; idle-expert on a diffusion stage of one rank, one lane (the
    swap policy counts one lane's steps: expert_policy.py), not compiled.
    (The model's two denoisers and a CUDA device are checked at its load.)"""
    if config.offload not in OFFLOAD_MODES:
        raise ConfigError(
            f"{where}: offload must be one of {', '.join(OFFLOAD_MODES)}, not {config.offload!r}"
        )
    if config.offload == "none":
        return
    flag = f"{where}: --offload {config.offload}"
    if not diffusion:
        raise ConfigError(f"{flag} runs diffusion stages only, not {config.kind!r}")
    if config.cfg_parallel or config.sequence_parallel > 1:
        raise ConfigError(
            f"{flag}: not with --cfg-parallel or --sequence-parallel (the ranks' denoiser calls "
            "follow rank 0's rows: each rank would have to swap its expert with rank 0's)"
        )
    groups = config.shape_groups
    if config.batch_level == "step" and isinstance(groups, int) and groups > 1:
        raise ConfigError(
            f"{flag}: not with --shape-groups {groups} (each lane of the running set would swap "
            "the one expert on the device for its own rows: lanes needing different experts "
            "would swap it at every step, and their rows' waits would not be bounded); pass "
            "--shape-groups 1"
        )
    if config.compile:
        raise ConfigError(
            f"{flag}: not with --compile yet (a compiled expert's graphs and its weights "
            "swapped in place between steps are not tested together)"
        )


def describe_cache(config: Any) -> dict[str, Any] | None:
    """What /health says of a stage's step cache (None: off)."""
    if config.cache == "none":
        return None
    return {
        "mode": config.cache,
        "threshold": cache_threshold(config),
        "decision": config.cache_decision,
    }


def cache_threshold(config: Any) -> float:
    """The stage's step-cache threshold: its own, else its decision's default."""
    if config.cache_threshold is None:
        return DEFAULT_THRESHOLDS[config.cache_decision]
    return float(config.cache_threshold)
