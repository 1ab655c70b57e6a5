"""Command-line flags: read here and nowhere else, into the frozen dataclasses of config.py.

Every flag has help text that shows its default; a stage flag's default is the StageConfig
field's own (None in argparse means "not given: keep the stage's value").
"""

from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, fields, replace

from vllm_omni_like.compile_choices import COMPILE_MODES, CUDA_GRAPH_COMPILE_MODES
from vllm_omni_like.config import (
    ATTENTION_BACKENDS,
    CHANNELS_LAST_MODES,
    LOAD_FORMATS,
    EngineConfig,
    Limits,
    PipelineConfig,
    ServerSettings,
    faults_from_env,
)
from vllm_omni_like.errors import ConfigError
from vllm_omni_like.pipelines.catalog import ARCH_OPTIONS
from vllm_omni_like.stage_flags import (
    add_batching_args,
    add_graph_args,
    add_lora_args,
    add_parallel_args,
    add_precision_args,
    stage_flag,
)

API_KEY_ENV = "VLLM_OMNI_LIKE_API_KEY"
INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
STAGE_FLAGS = (
    "load_format",
    "dtype",
    "device",
    "devices",
    "gpu_memory_fraction",
    "replicas",
    "cfg_parallel",
    "sequence_parallel",
    "max_batch_size",
    "batch_policy",
    "batch_wait",
    "batch_max_wait",
    "replica_queue",
    "routing",
    "batch_level",
    "shape_groups",
    "decode_group_rows",
    "decode_group_ms",
    "stall_timeout",
    "compile_timeout",
    "cold_step_timeout",
    "compile",
    "compile_mode",
    "attention",
    "channels_last",
    "warmup_sizes",
    "batch_buckets",
    "batched_cfg",
    "decode_overlap",
    "quantization",
    "offload",
    "regional_compile",
    "cache",
    "cache_threshold",
    "cache_decision",
    "loras",
    "lora_dir",
    "max_loras",
    "max_lora_rank",
    "max_loras_per_request",
    "cuda_graphs",
    "compile_text_encoders",
    "compile_cache",
    "max_side",
    "max_pixels",
    "max_frames",
    "max_steps",
)
MODEL_LIMIT_HELP = {
    "max_side": "largest width or height",
    "max_pixels": "n x width x height of one request",
    "max_frames": "frames of one video",
    "max_steps": "num_inference_steps",
}
LIMIT_HELP = {
    "max_upload_bytes": "bytes of one uploaded image or mask (413 over it)",
    "max_upload_pixels": "pixels of one uploaded image or mask (400 over it)",
    "max_body_bytes": "bytes of a request body (413 over it)",
    "max_prompt_chars": "characters of a prompt (400 over it)",
}
_ENGINE = {f.name: f.default for f in fields(EngineConfig) if f.default is not MISSING}
_SERVER = {f.name: f.default for f in fields(ServerSettings) if f.default is not MISSING}


# every mode is a choice, so a refused one meets its reason (config.py) rather than argparse's
COMPILE_CHOICES = COMPILE_MODES + CUDA_GRAPH_COMPILE_MODES
COMPILE_MODE_HELP = (
    "torch.compile's mode (reduce-overhead and max-autotune, which capture CUDA graphs of their "
    "own, are refused: they crash the worker at its first request; --cuda-graphs captures the "
    "stage's own)"
)
LOAD_FORMAT_HELP = "auto: the weights on disk; dummy: random weights"
DTYPE_HELP = "auto: fp16 on CUDA (bf16 with --quantization fp8), fp32 on the CPU"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="*",
        default=[],
        help=f"built-in pipeline name, architecture ({', '.join(ARCH_OPTIONS)}), YAML pipeline "
        "file or local diffusers directory (repeatable; default: tiny-omni tiny-image tiny-video)",
    )
    parser.add_argument(
        "--llm",
        help="local LLM directory to put in front of a diffusers directory as a prompt "
        "rewriter (default: none)",
    )
    g = parser.add_argument_group("stages (override every stage)")
    stage_flag(g, "load_format", LOAD_FORMAT_HELP, choices=LOAD_FORMATS)
    stage_flag(g, "dtype", DTYPE_HELP, choices=("auto", "fp32", "fp16", "bf16"))
    stage_flag(g, "device", "auto (CUDA if present), cpu, cuda or cuda:N")
    stage_flag(
        g,
        "devices",
        "one replica per device: GPU indices (0,1,2,3), cuda:N or cpu entries; each worker "
        "sees only its own GPU; --replicas defaults to their number (a YAML stage may name "
        "its own: devices: [1, 2, 3])",
        type=_device_list,
        metavar="0,1,...",
    )
    stage_flag(
        g,
        "gpu_memory_fraction",
        "the share of its GPU's memory each worker's allocator may take, so stages sharing "
        "a GPU do not starve each other (default: no cap)",
        type=float,
        metavar="F",
    )
    stage_flag(g, "replicas", "worker processes (replicas) per stage", type=int)
    add_parallel_args(g)
    stage_flag(
        g,
        "stall_timeout",
        "seconds a busy worker may report no step before it is killed and restarted; a "
        "step that the replica's measured speed expects to be slow gets 10x its expected time",
        type=float,
        metavar="S",
    )
    stage_flag(
        g,
        "compile_timeout",
        "seconds a step may take while its worker compiles (torch.compile says when it "
        "starts and ends; with --compile, a shape not warmed up at start-up)",
        type=float,
        metavar="S",
    )
    stage_flag(
        g,
        "cold_step_timeout",
        "seconds a step may take on a replica that has measured no step yet, nor has a "
        "replica of the same stage on the same kind of device; unset: twice --stall-timeout",
        type=float,
        metavar="S",
    )
    add_batching_args(parser)
    add_lora_args(parser)
    g = parser.add_argument_group("speed (diffusion stages)")
    stage_flag(
        g,
        "compile",
        "torch.compile the denoiser, warmed up at start-up for --warmup-size and a few "
        "batch-size buckets (batches are padded up to their bucket)",
        action="store_true",
        default=None,
    )
    stage_flag(g, "compile_mode", COMPILE_MODE_HELP, choices=COMPILE_CHOICES)
    add_precision_args(g)
    add_graph_args(g)
    stage_flag(
        g,
        "attention",
        "attention kernels; xformers falls back to sdpa with a warning when its kernels do not "
        "run here; fp8: our Triton kernel (Q, K, P and V in FP8, SageAttention's recipe) for "
        "the attention of FLUX.1, Qwen-Image, Z-Image and Wan, on CUDA 8.9+ in bf16",
        choices=ATTENTION_BACKENDS,
    )
    stage_flag(
        g,
        "channels_last",
        "NHWC for the conv UNet and image VAE (auto: on for a compiled UNet on CUDA, where it "
        "is faster; in eager mode it is slower)",
        choices=CHANNELS_LAST_MODES,
    )
    stage_flag(
        g,
        "batched_cfg",
        "both classifier-free-guidance halves in one forward where a pipeline calls its "
        "denoiser twice a step (Wan); same maths, rounded differently in 16-bit",
        action=argparse.BooleanOptionalAction,
    )
    stage_flag(
        g,
        "decode_overlap",
        "decode a batch (VAE, then pixels to the host) on a second thread and CUDA stream "
        "while the replica already denoises the next queued batch",
        action=argparse.BooleanOptionalAction,
    )
    g.add_argument(
        "--batch-buckets",
        type=_int_list,
        metavar="1,2,4,...",
        help="with --compile: the batch sizes (images per model call) compiled at start-up; "
        "a batch is padded up to the next one (default: those of 1, 2, 4, 8, 16, 24, 32 "
        "below --max-batch-size, and --max-batch-size itself)",
    )
    g.add_argument(
        "--warmup-size",
        dest="warmup_sizes",
        action="append",
        metavar="WxH",
        help="with --compile: an image/video size to compile and warm up for (repeatable; "
        "default: the model's own size)",
    )
    g = parser.add_argument_group("engine")
    for name, text in (
        ("max_restarts", "restarts of a stage's replicas before the stage is dead"),
        ("max_request_retries", "re-runs of a request whose worker died"),
        ("request_timeout", "seconds a request may take before it gets 504"),
        ("max_queue_size", "requests admitted per pipeline before 429"),
        (
            "max_queue_seconds",
            "work admitted per pipeline, in seconds at the replicas' measured speed, before "
            "429 (a request alone is always admitted; 0 = no such limit)",
        ),
    ):
        g.add_argument(
            "--" + name.replace("_", "-"),
            type=float if name in ("request_timeout", "max_queue_seconds") else int,
            default=_ENGINE[name],
            help=f"{text} (default: %(default)s)",
        )
    g.add_argument(
        "--executor",
        choices=("multiproc", "ray"),
        default="multiproc",
        help="how the workers run: processes of this host, or Ray actors on any node of a Ray "
        "cluster (the ray extra; docs: README, Serving across machines) (default: %(default)s)",
    )
    g.add_argument(
        "--ray-address",
        metavar="HOST:PORT",
        help="with --executor ray: the cluster to join (`ray start --head` prints it); "
        "default: a local Ray instance that starts and stops with the server",
    )
    g = parser.add_argument_group(
        "model limits (override every stage; default: the model's own, from what it was built "
        "or trained for, shown by /v1/models)"
    )
    for name, text in MODEL_LIMIT_HELP.items():
        g.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            metavar="N",
            help=f"{text} (default: the model's own)",
        )
    g = parser.add_argument_group("server-wide limits")
    for f in fields(Limits):
        g.add_argument(
            "--" + f.name.replace("_", "-"),
            type=int,
            default=f.default,
            metavar="N",
            help=f"{LIMIT_HELP[f.name]} (default: %(default)s)",
        )


def _device_list(text: str) -> tuple[str, ...]:
    values = tuple(v.strip() for v in text.split(",") if v.strip())
    if not values:
        raise argparse.ArgumentTypeError(f"expected devices like 0,1 or cpu,cpu, not {text!r}")
    return values


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,8,32, not {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, not {text!r}")
    return values


def stage_overrides(args: argparse.Namespace) -> dict[str, object]:
    found = {k: getattr(args, k) for k in STAGE_FLAGS if getattr(args, k, None) is not None}
    for name in ("warmup_sizes", "loras"):  # (repeatable flags)
        if name in found:
            found[name] = tuple(found[name])
    return found


def with_compile_cache(
    pipelines: tuple[PipelineConfig, ...], storage_dir: str
) -> tuple[PipelineConfig, ...]:
    """serve's stages that name no compile cache keep theirs under the storage dir, unless the
    host set TORCHINDUCTOR_CACHE_DIR (its own cache dir stays its own)."""
    if os.environ.get(INDUCTOR_CACHE_ENV):
        return pipelines
    where = os.path.join(storage_dir, "compile-cache")
    return tuple(
        replace(
            p,
            stages=tuple(
                s if s.compile_cache else replace(s, compile_cache=where) for s in p.stages
            ),
        )
        for p in pipelines
    )


def engine_config(args: argparse.Namespace, pipelines: tuple[PipelineConfig, ...]) -> EngineConfig:
    return EngineConfig(
        pipelines=pipelines,
        max_restarts=args.max_restarts,
        max_request_retries=args.max_request_retries,
        request_timeout=args.request_timeout,
        max_queue_size=args.max_queue_size,
        max_queue_seconds=args.max_queue_seconds,
        faults=faults_from_env(),
        executor=args.executor,
        ray_address=args.ray_address,
    )


def limits(args: argparse.Namespace) -> Limits:
    return Limits(**{f.name: getattr(args, f.name) for f in fields(Limits)})


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """The keys of --api-key and VLLM_OMNI_LIKE_API_KEY; an empty one is a start-up error (it
    would leave the server open while its operator believes it is closed)."""
    keys = list(getattr(args, "api_key", None) or [])
    if API_KEY_ENV in os.environ:
        keys.extend(os.environ[API_KEY_ENV].split(","))
    if any(not k.strip() for k in keys):
        raise ConfigError(
            f"an empty API key (--api-key '' or an empty entry in {API_KEY_ENV}) would leave "
            "the server open; give non-empty keys, or none for an open server"
        )
    return tuple(keys)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=_SERVER["host"], help="address to bind (default: %(default)s)")
    g.add_argument("--port", type=int, default=_SERVER["port"], help="(default: %(default)s)")
    g.add_argument(
        "--api-key",
        action="append",
        help=f"required as 'Authorization: Bearer KEY' (repeatable; or {API_KEY_ENV}=k1,k2; "
        "default: none, the server is open)",
    )
    for name, kind, text in (
        ("storage_dir", str, "video jobs (SQLite) and files"),
        ("video_timeout", float, "seconds a video job may take"),
        ("video_concurrency", int, "video jobs running at once"),
        ("url_ttl", float, "seconds image URLs live"),
        ("file_ttl", float, "seconds finished video files live"),
        ("drain_timeout", float, "seconds in-flight requests get to finish on SIGTERM"),
        ("header_timeout", float, "seconds a request's headers may take to arrive (else 408)"),
        ("body_timeout", float, "seconds a request's whole body may take after its headers"),
    ):
        g.add_argument(
            "--" + name.replace("_", "-"),
            type=kind,
            default=_SERVER[name],
            help=f"{text} (default: %(default)s)",
        )


def server_settings(args: argparse.Namespace) -> ServerSettings:
    return ServerSettings(
        host=args.host,
        port=args.port,
        api_keys=api_keys(args),
        storage_dir=args.storage_dir,
        video_timeout=args.video_timeout,
        video_concurrency=args.video_concurrency,
        url_ttl=args.url_ttl,
        file_ttl=args.file_ttl,
        drain_timeout=args.drain_timeout,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        limits=limits(args),
    )
