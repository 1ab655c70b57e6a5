"""Frozen configuration: the one place where environment variables and config files are read."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields
from typing import Any

from vllm_omni_like.errors import InvalidRequestError

FAULTS_ENV = "VLLM_OMNI_LIKE_FAULTS"
CACHE_ENV = "VLLM_OMNI_LIKE_CACHE"

FAULT_POINTS = ("load", "execute", "step", "output")
FAULT_KINDS = ("raise", "invalid", "oom", "exit", "hang")
STAGE_KINDS = ("llm", "diffusion", "null")
ATTENTION_BACKENDS = ("sdpa", "xformers")
CHANNELS_LAST_MODES = ("auto", "on", "off")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class FaultRule:
    """One rule of VLLM_OMNI_LIKE_FAULTS: where a stage fails on purpose, and for whom."""

    stage: str
    point: str
    kind: str
    match: str | None = None
    p: float | None = None
    seed: int = 0

    @classmethod
    def parse(cls, text: str) -> FaultRule:
        fields: dict[str, str] = {}
        for part in text.split(","):
            key, sep, value = part.strip().partition("=")
            if not sep or not key:
                raise ValueError(f"fault rule {text!r}: expected key=value, got {part!r}")
            fields[key.strip()] = value.strip()
        unknown = set(fields) - {"stage", "point", "kind", "match", "p", "seed"}
        if unknown:
            raise ValueError(f"fault rule {text!r}: unknown keys {sorted(unknown)}")
        for key in ("stage", "point", "kind"):
            if key not in fields:
                raise ValueError(f"fault rule {text!r}: missing {key}=")
        if fields["point"] not in FAULT_POINTS:
            raise ValueError(f"fault rule {text!r}: point must be one of {FAULT_POINTS}")
        if fields["kind"] not in FAULT_KINDS:
            raise ValueError(f"fault rule {text!r}: kind must be one of {FAULT_KINDS}")
        p = float(fields["p"]) if "p" in fields else None
        if p is not None and not 0.0 <= p <= 1.0:
            raise ValueError(f"fault rule {text!r}: p must be within [0, 1]")
        return cls(
            stage=fields["stage"],
            point=fields["point"],
            kind=fields["kind"],
            match=fields.get("match"),
            p=p,
            seed=int(fields.get("seed", "0")),
        )


def parse_faults(text: str | None) -> tuple[FaultRule, ...]:
    if not text:
        return ()
    return tuple(FaultRule.parse(rule) for rule in text.split(";") if rule.strip())


def faults_from_env() -> tuple[FaultRule, ...]:
    return parse_faults(os.environ.get(FAULTS_ENV))


def cache_dir() -> str:
    """Where the embedded default models are built (once, offline)."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "vllm_omni_like")
    return os.environ.get(CACHE_ENV, default)


@dataclass(frozen=True)
class StageConfig:
    """One stage of a pipeline: what runs, where, and how many replicas."""

    name: str
    kind: str
    model: str = ""  # local directory, or an embedded name such as "tiny-image"
    load_format: str = "auto"  # auto | dummy (same architecture, random weights)
    dtype: str = "auto"  # auto | fp32 | fp16 | bf16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    replicas: int = 1
    workers_per_replica: int = 1
    max_batch_size: int = 8
    # after a batch, an idle replica may wait this share of its run time for a full batch
    batch_wait: float = 0.1
    stall_timeout: float = 60.0
    load_timeout: float = 600.0
    # speed options of the diffusion stages (the denoiser): see stages/acceleration.py
    compile: bool = False
    compile_mode: str = "default"
    attention: str = "sdpa"  # sdpa | xformers (falls back to sdpa, with a warning)
    channels_last: str = "auto"  # auto (on for a compiled conv UNet on CUDA) | on | off
    warmup_sizes: tuple[str, ...] = ()  # "WxH" the compiled denoiser is warmed up for
    batch_buckets: tuple[int, ...] = ()  # images per call compiled for (default: 1,2,4,8,...)
    batched_cfg: bool = True  # both guidance halves in one forward where a pipeline runs two
    # a batch's VAE decode runs on the worker's finisher thread (a second CUDA stream) while
    # the next batch denoises
    decode_overlap: bool = True
    # what a request may ask of the model; None: the model's own (stages/model_limits.py)
    max_side: int | None = None
    max_pixels: int | None = None
    max_frames: int | None = None
    max_steps: int | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in STAGE_KINDS and ":" not in self.kind:
            raise InvalidRequestError(
                f"stage {self.name!r}: kind must be one of {STAGE_KINDS} or 'module:Class'"
            )
        if self.replicas < 1 or self.workers_per_replica < 1 or self.max_batch_size < 1:
            raise InvalidRequestError(f"stage {self.name!r}: replicas and sizes must be >= 1")
        if self.load_format not in ("auto", "dummy"):
            raise InvalidRequestError(f"stage {self.name!r}: load_format must be auto or dummy")
        for key, value, allowed in (
            ("compile_mode", self.compile_mode, COMPILE_MODES),
            ("attention", self.attention, ATTENTION_BACKENDS),
            ("channels_last", self.channels_last, CHANNELS_LAST_MODES),
        ):
            if value not in allowed:
                raise InvalidRequestError(
                    f"stage {self.name!r}: {key} must be one of {', '.join(allowed)}, not {value!r}"
                )
        if not 0.0 <= self.batch_wait <= 1.0:
            raise InvalidRequestError(f"stage {self.name!r}: batch_wait must be within [0, 1]")
        for key in ("max_side", "max_pixels", "max_frames", "max_steps"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InvalidRequestError(f"stage {self.name!r}: {key} must be an integer >= 1")
        if any(int(b) < 1 for b in self.batch_buckets):
            raise InvalidRequestError(f"stage {self.name!r}: batch buckets must be >= 1")
        for size in self.warmup_sizes:
            try:
                parse_size(size)
            except ValueError as exc:
                raise InvalidRequestError(f"stage {self.name!r}: warmup {exc}") from None


def parse_size(text: str) -> tuple[int, int]:
    """'WxH' -> (width, height); ValueError otherwise."""
    w, sep, h = str(text).lower().partition("x")
    if not sep or not w.isdigit() or not h.isdigit() or int(w) <= 0 or int(h) <= 0:
        raise ValueError(f"size must be 'WIDTHxHEIGHT', not {text!r}")
    return int(w), int(h)


@dataclass(frozen=True)
class PipelineConfig:
    """A named chain of stages; `kind` says how one stage's output feeds the next."""

    name: str
    stages: tuple[StageConfig, ...]
    output: str = "image"  # image | video


@dataclass(frozen=True)
class Limits:
    """Server-wide request limits (over one is 400, 413 for bytes). What may be asked of a
    model (sizes, frames, steps) is the model's own: StageConfig.max_* and model_limits.py."""

    max_upload_bytes: int = 20 * 1024 * 1024
    max_upload_pixels: int = 4096 * 4096
    max_body_bytes: int = 64 * 1024 * 1024
    max_prompt_chars: int = 32_000


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    storage_dir: str = "./storage"
    video_timeout: float = 1800.0
    video_concurrency: int = 4
    url_ttl: float = 3600.0  # image URLs expire after this
    file_ttl: float = 24 * 3600.0  # finished video files expire after this
    keepalive_s: float = 15.0
    drain_timeout: float = 30.0
    limits: Limits = field(default_factory=Limits)


@dataclass(frozen=True)
class EngineConfig:
    pipelines: tuple[PipelineConfig, ...]
    max_restarts: int = 3
    max_request_retries: int = 1
    request_timeout: float = 600.0
    max_queue_size: int = 256
    faults: tuple[FaultRule, ...] = ()


# ---- command-line flags: read here and nowhere else ----------------------------------------------

STAGE_FLAGS = (
    "load_format",
    "dtype",
    "device",
    "replicas",
    "max_batch_size",
    "batch_wait",
    "stall_timeout",
    "compile",
    "compile_mode",
    "attention",
    "channels_last",
    "warmup_sizes",
    "batch_buckets",
    "batched_cfg",
    "decode_overlap",
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
    "max_upload_pixels": "pixels of one uploaded image or mask",
    "max_body_bytes": "bytes of a request body (413 over it)",
    "max_prompt_chars": "characters of a prompt",
}
API_KEY_ENV = "VLLM_OMNI_LIKE_API_KEY"


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model",
        nargs="*",
        default=[],
        help="built-in pipeline name, YAML pipeline file or local diffusers "
        "directory (repeatable; default: tiny-omni tiny-image tiny-video)",
    )
    parser.add_argument("--llm", help="local LLM directory to put in front as a prompt stage")
    g = parser.add_argument_group("stages (override every stage)")
    g.add_argument("--load-format", choices=("auto", "dummy"))
    g.add_argument("--dtype", choices=("auto", "fp32", "fp16", "bf16"))
    g.add_argument("--device", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--replicas", type=int)
    g.add_argument("--max-batch-size", type=int)
    g.add_argument(
        "--batch-wait",
        type=float,
        metavar="SHARE",
        help="after a batch of N, a replica waits up to SHARE x that batch's run time for N "
        "requests to queue (closed-loop clients coming back), so batches stay whole "
        "(default 0.1; 0 = never wait)",
    )
    g.add_argument("--stall-timeout", type=float)
    g = parser.add_argument_group("speed (diffusion stages)")
    g.add_argument(
        "--compile",
        action="store_true",
        default=None,
        help="torch.compile the denoiser, warmed up at start-up for --warmup-size and a few "
        "batch-size buckets (batches are padded up to their bucket)",
    )
    g.add_argument("--compile-mode", choices=COMPILE_MODES)
    g.add_argument(
        "--attention",
        choices=ATTENTION_BACKENDS,
        help="attention kernels (default sdpa); xformers falls back to sdpa with a warning "
        "when its kernels do not run here",
    )
    g.add_argument(
        "--channels-last",
        choices=CHANNELS_LAST_MODES,
        help="NHWC for the conv UNet and image VAE (default auto: on for a compiled UNet on "
        "CUDA, where it is faster; in eager mode it is slower)",
    )
    g.add_argument(
        "--batched-cfg",
        action=argparse.BooleanOptionalAction,
        help="both classifier-free-guidance halves in one forward where a pipeline calls its "
        "denoiser twice a step (Wan); same maths, rounded differently in 16-bit (default on)",
    )
    g.add_argument(
        "--decode-overlap",
        action=argparse.BooleanOptionalAction,
        help="decode a batch (VAE, then pixels to the host) on a second thread and CUDA stream "
        "while the replica already denoises the next queued batch (default on)",
    )
    g.add_argument(
        "--batch-buckets",
        type=_int_list,
        metavar="1,2,4,...",
        help="with --compile: the batch sizes (images per model call) compiled at start-up; "
        "a batch is padded up to the next one (default: powers of two up to --max-batch-size)",
    )
    g.add_argument(
        "--warmup-size",
        dest="warmup_sizes",
        action="append",
        metavar="WxH",
        help="image/video size to compile and warm up for (repeatable; default: the model's)",
    )
    g = parser.add_argument_group("engine")
    g.add_argument("--max-restarts", type=int, default=3)
    g.add_argument("--max-request-retries", type=int, default=1)
    g.add_argument("--request-timeout", type=float, default=600.0)
    g.add_argument("--max-queue-size", type=int, default=256)
    g = parser.add_argument_group(
        "model limits (override every stage; default: the model's own, from what it was built "
        "or trained for, shown by /v1/models)"
    )
    for name, text in MODEL_LIMIT_HELP.items():
        g.add_argument("--" + name.replace("_", "-"), type=int, metavar="N", help=text)
    g = parser.add_argument_group("server-wide limits")
    for f in fields(Limits):
        g.add_argument(
            "--" + f.name.replace("_", "-"),
            type=int,
            default=f.default,
            metavar="N",
            help=LIMIT_HELP[f.name],
        )


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
    if "warmup_sizes" in found:
        found["warmup_sizes"] = tuple(found["warmup_sizes"])
    return found


def engine_config(args: argparse.Namespace, pipelines: tuple[PipelineConfig, ...]) -> EngineConfig:
    return EngineConfig(
        pipelines=pipelines,
        max_restarts=args.max_restarts,
        max_request_retries=args.max_request_retries,
        request_timeout=args.request_timeout,
        max_queue_size=args.max_queue_size,
        faults=faults_from_env(),
    )


def limits(args: argparse.Namespace) -> Limits:
    return Limits(**{f.name: getattr(args, f.name) for f in fields(Limits)})


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    keys = list(getattr(args, "api_key", None) or [])
    if os.environ.get(API_KEY_ENV):
        keys.extend(k for k in os.environ[API_KEY_ENV].split(",") if k)
    return tuple(keys)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--api-key",
        action="append",
        help=f"required as 'Authorization: Bearer KEY' (repeatable; or {API_KEY_ENV})",
    )
    g.add_argument("--storage-dir", default="./storage", help="video jobs (SQLite) and files")
    g.add_argument("--video-timeout", type=float, default=1800.0)
    g.add_argument("--video-concurrency", type=int, default=4)
    g.add_argument("--url-ttl", type=float, default=3600.0, help="seconds image URLs live")
    g.add_argument("--file-ttl", type=float, default=86400.0, help="seconds video files live")
    g.add_argument("--drain-timeout", type=float, default=30.0)


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
        limits=limits(args),
    )
