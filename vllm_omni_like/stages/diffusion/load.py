"""The diffusion stage's load, step by step in the order it must run: a model directory to one
`DiffusionRuntime` (runtime.py). The compile warm-up is the stage's, through its two loops,
once this has built them their runtime."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch

from vllm_omni_like.compile_choices import text_encoders_compiled
from vllm_omni_like.config import StageConfig
from vllm_omni_like.models import limits as model_limits
from vllm_omni_like.models.adapter import Adapter, adapter_for
from vllm_omni_like.models.family import Family, Loop
from vllm_omni_like.models.limits import check_step_cache
from vllm_omni_like.models.precision import check_attention, check_quantization
from vllm_omni_like.models.registry import family_of, loops_for
from vllm_omni_like.models.tiny import TINY_NAMES, ensure_tiny_model
from vllm_omni_like.parallel.rank_link import Link
from vllm_omni_like.parallel.ranks import Ranks
from vllm_omni_like.speed_settings import cache_threshold
from vllm_omni_like.stage_options import DiffusionOptions
from vllm_omni_like.stages.diffusion import acceleration as accel
from vllm_omni_like.stages.diffusion import (
    encoder_lookups,
    lora_pool,
    offload,
    precompiled,
    quantize,
    ranks_load,
)
from vllm_omni_like.stages.diffusion.block_cache import FirstBlockCache
from vllm_omni_like.stages.diffusion.fp8_attention import check_fp8_attention
from vllm_omni_like.stages.diffusion.graphs import GraphRunner, backend_for
from vllm_omni_like.stages.diffusion.host_scheduler import host_scheduler
from vllm_omni_like.stages.diffusion.lora_pool import LoraPool
from vllm_omni_like.stages.diffusion.prompt_embeds import PromptEncoder
from vllm_omni_like.stages.diffusion.runtime import (
    Defaults,
    DiffusionRuntime,
    Speed,
)
from vllm_omni_like.stages.diffusion.step import DenoiseLoop
from vllm_omni_like.stages.torch_utils import (
    BatchDimProbe,
    check_model_dir,
    dummy_pipeline,
    quiet_loading,
    resolve_device,
    resolve_dtype,
)
from vllm_omni_like.stages.trace import BatchTracer
from vllm_omni_like.wire import Mode

# the stage's logger: what the load says comes from the stage, under the name it always had
logger = logging.getLogger("vllm_omni_like.stages.diffusion.stage")


def load_runtime(
    config: StageConfig, options: DiffusionOptions, ranks: Ranks, device_name: str
) -> DiffusionRuntime:
    """Load `config.model` onto `device_name` and build what runs it."""
    # 1. where it runs: the device, the replica's other ranks (they load meanwhile)
    path, device = _model_dir(config), resolve_device(device_name)
    dtype = resolve_dtype(config.dtype, device, quantize.gpu_dtype(config))
    link = ranks_load.connect_ranks(config, ranks, device)
    tracer = BatchTracer(config.name, ranks.rank, device)
    # 2. the pipeline and its family's adapter; per mode, our own loop or the pipeline's call
    family, pipe, adapter = _load_pipeline(config, path, device, dtype)
    loops, own = _choose_loops(config.name, path, family)
    # 3. text, limits, what a request leaves unsaid
    text = _prompt_encoder(config, pipe, adapter, options, device, set(family.modes) - own)
    limits = model_limits.diffusion_limits(config)
    # 4. speed: kernels, memory format; FP8, the sequence-parallel split, compiled with them
    speed = _speed_up(config, pipe, adapter, device, pipeline_loop=set(loops) - own)
    precision, loras, buckets = _denoisers(config, options, ranks, link, adapter, device, dtype)
    # 5. our own loop (LoRA pool, offload); sequence parallelism: rank 0's forwards on each rank
    denoise = _own_loop(config, adapter, device, text, (buckets, loras), set(family.modes) - own)
    seq_ranks = ranks_load.sequence_ranks(config, ranks, link, pipe, adapter, loras)
    # 6. guidance: batched, or split over the ranks (rank 1 keeps its denoiser only)
    cfg, cfg_ranks = ranks_load.guidance(config, ranks, link, tracer, adapter, denoise, loops)
    # 7. what runs beside the steps (rank 0): the batch probe, edit pipelines, side stream
    probe, edit_pipes, side_stream = _beside(config, ranks, pipe, adapter, device, cfg)
    return DiffusionRuntime(
        config=config,
        device=device,
        dtype=dtype,
        tracer=tracer,
        family=family,
        pipe=pipe,
        adapter=adapter,
        loops=loops,
        own=own,
        text=text,
        limits=limits,
        defaults=_defaults(limits, options, family),
        speed=speed,
        precision=precision,
        scheduler=pipe.scheduler,  # the pipeline call's default
        buckets=buckets,
        denoise=denoise,
        cfg=cfg,
        cfg_ranks=cfg_ranks,
        seq_ranks=seq_ranks,
        probe=probe,
        edit_pipes=edit_pipes,
        side_stream=side_stream,
    )


def _model_dir(config: StageConfig) -> str:
    """The model's directory (a tiny model built on first use), checked before any loading
    (which is quiet from here on)."""
    quiet_loading()
    path = config.model or "tiny-image"
    if path in TINY_NAMES:
        path = ensure_tiny_model(path)
    check_model_dir(path, "model_index.json")
    return path


def _check_text_encoder(config: StageConfig, path: str) -> None:
    with open(os.path.join(path, "model_index.json")) as f:
        entry = json.load(f).get("text_encoder", ["present"])
    if entry[0] is None and config.load_format != "dummy":
        raise FileNotFoundError(
            f"{config.model!r} has no text encoder; only --load-format dummy "
            "runs it (on seeded random prompt embeddings)"
        )


def _load_pipeline(
    config: StageConfig, path: str, device: torch.device, dtype: torch.dtype
) -> tuple[Family, Any, Adapter]:
    """The pipeline on `device` (random weights with `--load-format dummy`), its family and
    the family's adapter."""
    import diffusers

    _check_text_encoder(config, path)
    family = family_of(path)
    check_step_cache(config.name, family, config.cache)  # (refused before anything loads)
    if config.quantization == "fp8":  # refused before anything loads
        check_quantization(config.name, family, config.quantization)
        quantize.check_fp8(device, dtype)
    offload.check_device(config, device)
    if config.attention == "fp8":  # likewise
        check_attention(config.name, family, config.attention)
        check_fp8_attention(device, dtype)
    own = family.adapter_class().own_components(path)
    if config.load_format == "dummy":
        pipe = dummy_pipeline(path, device, dtype, own)
    else:
        pipe = diffusers.DiffusionPipeline.from_pretrained(
            path, local_files_only=True, dtype=dtype, **own
        )
    pipe.set_progress_bar_config(disable=True)
    pipe = pipe.to(device)
    accel.pin_execution_device(pipe, device)
    encoder_lookups.pin(pipe, device)
    adapter = adapter_for(pipe, family)
    if (warning := adapter.load_warning()) is not None:
        logger.warning("stage %s: %s", config.name, warning)
    return family, pipe, adapter


def _say_experts(
    name: str, adapter: Adapter, offloaded: offload.ExpertOffload | None, device: torch.device
) -> None:
    """A model of two experts (Wan2.2-A14B) says at start-up where each is: with `--offload
    idle-expert` one on the device, the other in host memory, and the device memory held;
    else both on the device (an H200 holds the bf16 A14B pair)."""
    experts = adapter.experts()
    if offloaded is not None:
        logger.info("stage %s: %s", name, offload.describe(offloaded, device))
    elif len(experts) > 1:
        where = ", ".join(f"{e.name} on {next(e.model.parameters()).device}" for e in experts)
        boundary = experts[0].boundary
        logger.info(
            "stage %s: two experts switched at timestep %g: %s (none offloaded)",
            name,
            boundary,
            where,
        )


def _choose_loops(
    name: str, path: str, family: Family
) -> tuple[dict[Mode, tuple[Loop, str | None]], set[Mode]]:
    """Per mode: our own denoising loop, or the pipeline's call and why (logged where the
    family's own loop would have run it); and the modes our own loop runs."""
    loops = loops_for(path)
    own = {mode for mode, (loop, _) in loops.items() if loop == "own"}
    for mode, (_, why) in loops.items():
        if mode in family.own_loop and why is not None:
            logger.warning("stage %s: %s runs the pipeline's call: %s", name, mode, why)
    return loops, own


def _prompt_encoder(
    config: StageConfig,
    pipe: Any,
    adapter: Adapter,
    options: DiffusionOptions,
    device: torch.device,
    pipeline_loop: set[Mode],
) -> PromptEncoder:
    """The text encoders (compiled with --compile-text-encoders where every mode runs our own
    loop: the pipeline's call encodes a batch at a time, a shape a batch size), or a dummy's
    seeded random embeddings where it has none."""
    denoiser_dtype = getattr(pipe, adapter.denoiser_name).dtype  # (`dtype` walks modules)
    tokenizer = getattr(pipe, "tokenizer", None)
    random_shape = None
    if "text_encoder" in pipe.components and pipe.text_encoder is None:
        random_shape = options.max_sequence_length, adapter.text_embed_dim()
    compiled: list[str] = []
    if random_shape is None and text_encoders_compiled(config, device.type):
        if pipeline_loop:
            logger.info(
                "stage %s: text encoders eager: %s run the pipeline's call",
                config.name,
                ", ".join(sorted(pipeline_loop)),
            )
        else:
            compiled = accel.compile_text_encoders(
                adapter, config.compile_mode, options.compile_backend
            )
            logger.info(
                "stage %s: compiled text encoders %s",
                config.name,
                ", ".join(compiled) or "(none: the family names none)",
            )
    return PromptEncoder(adapter, device, tokenizer, random_shape, denoiser_dtype, bool(compiled))


def _defaults(
    limits: model_limits.ModelLimits, options: DiffusionOptions, family: Family
) -> Defaults:
    guidance = options.default_guidance
    return Defaults(
        width=limits.default_width,
        height=limits.default_height,
        steps=limits.default_steps,
        guidance=guidance if guidance is not None else family.default_guidance,
        frames=limits.default_frames or 9,
    )


def _speed_up(
    config: StageConfig,
    pipe: Any,
    adapter: Adapter,
    device: torch.device,
    pipeline_loop: set[Mode],
) -> Speed:
    """Attention kernels, memory format, tuned kernels; UniPC on the host where the pipeline's
    call runs a mode (`pipeline_loop`)."""
    attention = accel.set_attention(pipe, config.attention, device, config.name)
    channels_last = accel.use_channels_last(
        adapter, config.channels_last, device, compiled=config.compile
    )
    tuned = accel.tune_kernels(adapter, device, attention, compiled=config.compile)
    if attention == "fp8":  # (after fusing: the processors that then run are routed)
        tuned.append(accel.fp8_attention(adapter, config.name))
    if pipeline_loop and host_scheduler(pipe):  # the same steps, none waiting on the device
        tuned.append("UniPC coefficients on the host")
    logger.info(
        "stage %s: attention %s, channels_last %s, %s",
        config.name,
        attention,
        channels_last,
        ", ".join(tuned) or "default kernels",
    )
    return Speed(attention, channels_last, tuned)


def _denoisers(
    config: StageConfig,
    options: DiffusionOptions,
    ranks: Ranks,
    link: Link | None,
    adapter: Adapter,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[str, LoraPool | None, tuple[int, ...]]:
    """The denoisers as they will run, in this order: FP8 matmuls (other maths; made from the
    fused 16-bit weights), the LoRA layers around them, the sequence-parallel split, all
    compiled in; returns the precision the stage runs, its LoRA pool and the batch buckets
    compiled."""
    precision = _quantize(config, adapter, device, dtype)
    loras = lora_pool.build(config, adapter, device, dtype, leader=ranks.rank == 0)
    ranks_load.split_sequence(config, ranks, link, adapter)
    return precision, loras, _compile(config, options, adapter)


def _quantize(
    config: StageConfig, adapter: Adapter, device: torch.device, dtype: torch.dtype
) -> str:
    """`--quantization fp8`: the denoisers' linear layers FP8 by their family's rule (after
    the fused projections are made from the 16-bit weights); the log says the denoisers'
    memory either way. Returns the precision the stage runs (`/health`)."""
    if config.quantization == "fp8":
        done = quantize.describe(quantize.quantize_denoisers(adapter, device))
        logger.info("stage %s: FP8 matmuls (rowwise, torch._scaled_mm): %s", config.name, done)
        logger.info("stage %s: %s", config.name, quantize.torchao_state())
    else:
        held = ", ".join(
            f"{e.name} {quantize.size(quantize.model_bytes(e.model))}" for e in adapter.experts()
        )
        logger.info("stage %s: %s (%s)", config.name, held, quantize.precision_of("none", dtype))
    return quantize.precision_of(config.quantization, dtype, config.attention)


def _compile(config: StageConfig, options: DiffusionOptions, adapter: Adapter) -> tuple[int, ...]:
    """Compile what the adapter names (each denoiser block by block where regional); returns
    the batch buckets it runs (none: eager)."""
    if not config.compile:
        return ()
    backend = options.compile_backend
    precompile = precompiled.for_stage(config, backend)
    compiled = accel.compile_models(
        adapter, config.compile_mode, backend, config.regional, precompile
    )
    logger.info("stage %s: compiled %s (%s)", config.name, ", ".join(compiled), backend)
    configured = config.batch_buckets or options.batch_buckets
    return accel.buckets_for(config.max_batch_size, configured)


def _own_loop(
    config: StageConfig,
    adapter: Adapter,
    device: torch.device,
    text: PromptEncoder,
    compiled: tuple[tuple[int, ...], LoraPool | None],
    pipeline_modes: set[Mode],
) -> DenoiseLoop:
    """Our own loop, its model rows padded to the buckets (each bucket of images with
    guidance and without), each row with its LoRA adapters where the stage has a pool; with
    `--cache first-block`, its rows' step cache around the denoiser's blocks (compiled, where
    they are, before); with `--offload idle-expert`, the idle expert in host memory (none of
    `pipeline_modes` may run then: the pipeline's call runs both experts)."""
    buckets, loras = compiled
    batched = config.batched_cfg and not config.cfg_parallel  # (CFG-parallel: a branch a rank)
    row_buckets = accel.model_row_buckets(adapter, buckets, batched)
    graphs = GraphRunner(backend_for(config, device), config.name)
    loop = DenoiseLoop(adapter, device, text, row_buckets, batched, loras, graphs)
    if config.cache == "first-block":
        stack = adapter.block_stack()  # (a family that has none refuses here: ConfigError)
        loop.cache = FirstBlockCache(stack, row_buckets, config.cache_decision == "lagged")
        loop.cache_threshold = cache_threshold(config)
        logger.info(
            "stage %s: First-Block Cache over %d blocks, threshold %g, decision %s",
            config.name,
            loop.cache.depth,
            loop.cache_threshold,
            config.cache_decision,
        )
    loop.offload = offload.build(config, adapter, device, pipeline_modes)
    _say_experts(config.name, adapter, loop.offload, device)
    return loop


def _beside(
    config: StageConfig,
    ranks: Ranks,
    pipe: Any,
    adapter: Adapter,
    device: torch.device,
    cfg: ranks_load.CfgWrapper | None,
) -> tuple[BatchDimProbe, dict[str, Any], torch.cuda.Stream | None]:
    """The batch probe, the edit pipelines and the side stream (a rank rank 0 leads, serving
    its denoiser only, needs none of them: its probe is attached to nothing)."""
    probe = BatchDimProbe()
    if config.leads and ranks.rank > 0:
        return probe, {}, None
    # on the model itself: it sees the batch the kernels get
    probe.attach(cfg.model if cfg is not None else getattr(pipe, adapter.denoiser_name))
    edit_pipes = adapter.edit_pipelines(config.name)
    # the decode of a deferred batch runs here, beside the next batch's steps
    side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    return probe, edit_pipes, side_stream
