"""The flags that override every stage's field: the parallel and batching groups of them, and
the precision flags of the speed group."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, fields
from typing import Any

from vllm_omni_like.compile_choices import (
    CUDA_GRAPHS_MODES,
    REGIONAL_COMPILE_MODES,
    TEXT_ENCODER_COMPILE_MODES,
)
from vllm_omni_like.config import BATCH_LEVELS, BATCH_POLICIES, QUANTIZATIONS, ROUTINGS, StageConfig
from vllm_omni_like.speed_settings import (
    CACHE_DECISIONS,
    CACHE_MODES,
    DEFAULT_THRESHOLDS,
    OFFLOAD_MODES,
)

_STAGE = {f.name: f.default for f in fields(StageConfig) if f.default is not MISSING}


def on_off(value: bool) -> str:
    return "on" if value else "off"


def stage_flag(g: Any, name: str, text: str, **kw: Any) -> None:
    """A flag that overrides every stage's field `name`; its help shows the field's default."""
    default = _STAGE[name]
    shown = kw.pop("shown", on_off(default) if isinstance(default, bool) else default)
    g.add_argument("--" + name.replace("_", "-"), help=f"{text} (default: {shown})", **kw)


def add_parallel_args(g: Any) -> None:
    """One request over several devices of a replica (in the stages group)."""
    stage_flag(
        g,
        "cfg_parallel",
        "diffusion stages: a replica spans two devices (two ranks, NCCL on CUDA, gloo on the "
        "CPU), each running one classifier-free-guidance branch of every step: lower latency "
        "per request; --devices are taken two by two, --replicas defaults to half of them",
        action="store_true",
        default=None,
    )
    stage_flag(
        g,
        "sequence_parallel",
        "diffusion stages (Wan, FLUX.1, Qwen-Image and -Edit, SD3.5, Z-Image): a replica "
        "spans N devices (N ranks), each holding 1/N of every denoiser forward's latent "
        "tokens and the whole model, attention exchanging heads for tokens (Ulysses), and "
        "(Wan) decoding a band of each video: lower latency for one large video or image; "
        "--devices are taken N by N, --replicas defaults to their number / N; its decodes do "
        "not overlap the next steps (--decode-overlap is off); with --cfg-parallel, 2 x N "
        "ranks (a group of N for each guidance branch, --devices taken 2N by 2N)",
        type=int,
        metavar="N",
    )


def add_batching_args(parser: argparse.ArgumentParser) -> None:
    """How requests batch, join running sets and pick replicas (every stage)."""
    g = parser.add_argument_group("batching (override every stage)")
    stage_flag(g, "max_batch_size", "requests per batch (a running set: in it at once)", type=int)
    stage_flag(
        g,
        "batch_policy",
        "when an idle replica takes its next batch: request (wait for a full batch at most "
        "--batch-max-wait seconds from the oldest queued request) or refill (after a batch, "
        "wait for its clients to come back: --batch-wait)",
        choices=BATCH_POLICIES,
    )
    stage_flag(
        g,
        "batch_wait",
        "refill policy: after a batch of N, a replica waits up to SHARE x that batch's run time "
        "for N requests to queue (closed-loop clients coming back), so batches stay whole; "
        "0 = never wait",
        type=float,
        metavar="SHARE",
    )
    stage_flag(
        g,
        "batch_max_wait",
        "request policy: seconds the oldest queued request may wait for a full batch "
        "(0 = never wait)",
        type=float,
        metavar="S",
    )
    stage_flag(
        g,
        "replica_queue",
        "batches a replica may hold queued at its worker beyond the one it runs (0: a batch "
        "is given to a replica only when it is free); with more, routing spreads them",
        type=int,
        metavar="N",
    )
    stage_flag(
        g,
        "batch_level",
        "step: a request joins a busy replica's running set at the next step boundary and "
        "leaves when its own steps are done; request: each batch runs whole (the set takes no "
        "joins)",
        choices=BATCH_LEVELS,
    )
    stage_flag(
        g,
        "shape_groups",
        "shape groups (size, frames, mode) a replica's running set holds side by side, one "
        "stepping at a time: the one that waited longest since its last step goes next",
        type=int,
        metavar="N",
    )
    stage_flag(
        g,
        "decode_group_rows",
        "a running set's finished rows decode together (off its steps, on the finisher) "
        "once this many have ended ...",
        type=int,
        metavar="K",
    )
    stage_flag(
        g,
        "decode_group_ms",
        "... or once the first of them ended this many milliseconds ago (or the set drained)",
        type=float,
        metavar="T",
    )
    stage_flag(
        g,
        "routing",
        "which replica gets a batch: cost (where it would end first: the work each replica "
        "holds, in seconds at its measured speed) or count (the fewest requests held)",
        choices=ROUTINGS,
    )


def add_precision_args(g: Any) -> None:
    """Low precision and the compile that keeps its warm-up short (the speed group `g`)."""
    stage_flag(
        g,
        "quantization",
        "fp8: the transformer's linear layers run rowwise dynamic FP8 matmuls (torch._scaled_mm; "
        "weights quantized as they load, the layers its family keeps in the weights' dtype "
        "aside): FLUX.1, SD3, Qwen-Image, Z-Image and Wan; CUDA compute capability 8.9 or newer "
        "(or the CPU); /health says each stage's precision",
        choices=QUANTIZATIONS,
    )
    stage_flag(
        g,
        "offload",
        "idle-expert: a two-expert model's (Wan2.2-T2V/I2V-A14B) expert not in use waits in "
        "pinned host memory and one expert is on the device (bf16 A14B on one 80 GB GPU); the "
        "next expert streams in on a copy stream, block by block, overlapping the steps; a "
        "running set steps the resident expert's rows while the other's wait (at most "
        "4 steps); CUDA only; /health says the resident expert and its swaps",
        choices=OFFLOAD_MODES,
    )
    stage_flag(
        g,
        "regional_compile",
        "with --compile: each repeated transformer block compiled on its own, one graph a kind "
        "of block reused by every block of it, instead of the whole denoiser: a fraction of the "
        "warm-up (auto: on with --quantization fp8 or --cache)",
        choices=REGIONAL_COMPILE_MODES,
    )
    add_cache_args(g)


def add_cache_args(g: Any) -> None:
    """The step cache (the speed group `g`)."""
    stage_flag(
        g,
        "cache",
        "first-block: each row of our own loop runs the transformer's first block every step "
        "and its other blocks only where the first block's residual changed by more than "
        "--cache-threshold since they last ran (else it reuses what they added then): FLUX.1, "
        "SD3, Qwen-Image, Z-Image and Wan (not A14B); a request may send its own threshold "
        '("cache": {"threshold": T}); /health says each stage\'s',
        choices=CACHE_MODES,
    )
    stage_flag(
        g,
        "cache_threshold",
        "the relative change (mean |r - r_ref| / mean |r_ref|) of a row's first-block "
        "residual under which it reuses; 0: never (the uncached images, bit for bit)",
        type=float,
        metavar="T",
        shown=", ".join(f"{t:g} with {d}" for d, t in DEFAULT_THRESHOLDS.items()),
    )
    stage_flag(
        g,
        "cache_decision",
        "sync: each row decides from this step's first block (one device-to-host read a "
        "step); lagged: from its step before's, so the host never waits for the device",
        choices=CACHE_DECISIONS,
    )


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    """LoRA adapters of the diffusion stages (stages/diffusion/lora_pool.py)."""
    g = parser.add_argument_group("LoRA adapters (diffusion stages, our own loop)")
    g.add_argument(
        "--lora",
        dest="loras",
        action="append",
        metavar="NAME=PATH",
        help="a LoRA adapter (a .safetensors file: diffusers/peft, or kohya-style for SD1.5, "
        "SDXL and FLUX.1) a request picks by NAME (`lora` field, or model BASE:NAME), read and "
        "checked at start-up; repeatable; replaces a YAML stage's `loras:` (default: none)",
    )
    stage_flag(
        g,
        "lora_dir",
        "a directory whose NAME.safetensors files requests may pick by NAME at run time (read "
        "when first asked for; no name leaves the directory)",
        metavar="DIR",
    )
    stage_flag(
        g,
        "max_loras",
        "adapters held on the device at once (least recently used evicted, never one a "
        "running request uses)",
        type=int,
        metavar="N",
    )
    stage_flag(
        g,
        "max_lora_rank",
        "the device pool's rank: lower ranks are padded to it, higher ones refused",
        type=int,
        metavar="R",
    )
    stage_flag(
        g,
        "max_loras_per_request",
        "adapters one request may combine (each row's update gathers this many a layer: rows "
        "with fewer read the empty slot for the rest)",
        type=int,
        metavar="K",
    )


def add_graph_args(g: Any) -> None:
    """CUDA graphs of the compiled forward, and the cache that makes a start or restart short
    (the speed group `g`)."""
    stage_flag(
        g,
        "cuda_graphs",
        "with --compile: each compiled bucket's denoiser forward captured once as a CUDA graph "
        "after its warm-up and replayed every step over static buffers (rows joining and "
        "leaving are copied in; all buckets share one memory pool; a capture that fails falls "
        "back to the compiled forward with a warning; /health lists each replica's graphs); "
        "auto: on CUDA, for a replica of one rank",
        choices=CUDA_GRAPHS_MODES,
    )
    stage_flag(
        g,
        "compile_text_encoders",
        "with --compile: the text encoders compiled too, each text encoded alone at its "
        "family's fixed token length (one graph an encoder, warmed up at start-up), so a "
        "request's join is not launch-bound: SD1.5, SDXL, SD3, FLUX.1, Z-Image, Wan (not "
        "Qwen-Image, nor a mode the pipeline's own call runs); adds their compile to the "
        "start-up; auto: on CUDA",
        choices=TEXT_ENCODER_COMPILE_MODES,
    )
    stage_flag(
        g,
        "compile_cache",
        "with --compile: the directory compiled graphs and kernels persist in (torch "
        "inductor's FX graph and AOTAutograd caches), so a later start, or a replica restarted "
        "after its worker died, loads them instead of compiling",
        metavar="DIR",
        shown="serve: <--storage-dir>/compile-cache unless TORCHINDUCTOR_CACHE_DIR is set; "
        "generate: that variable, else ~/.cache/vllm_omni_like/inductor",
    )
