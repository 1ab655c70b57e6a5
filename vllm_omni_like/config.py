"""Frozen configuration, and the environment variables it takes (faults, the cache directory).
The command-line flags that fill it are read in flags.py (with VLLM_OMNI_LIKE_API_KEY), a YAML
pipeline file in pipelines/catalog.py; what it refuses raises `ConfigError`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from vllm_omni_like.compile_choices import (
    COMPILE_MODES,
    CUDA_GRAPHS_MODES,
    REGIONAL_COMPILE_MODES,
    check_compile,
)
from vllm_omni_like.errors import ConfigError
from vllm_omni_like.loras import PER_REQUEST, LoraSpec, check_loras
from vllm_omni_like.speed_settings import check_speed
from vllm_omni_like.stage_options import parse_options

FAULTS_ENV = "VLLM_OMNI_LIKE_FAULTS"
CACHE_ENV = "VLLM_OMNI_LIKE_CACHE"

# template, tokenize, constraint, detokenize: one row of an LLM stage's batch (the others run on)
FAULT_POINTS: tuple[str, ...] = ("load", "execute", "step", "output", "store")
FAULT_POINTS += ("template", "tokenize", "constraint", "detokenize")  # an LLM stage's rows
FAULT_KINDS = ("raise", "invalid", "oom", "exit", "hang", "slow", "enospc")
# point=store fails the API's file writes: stage= names the store, kind= is enospc or raise
STORES = ("files", "videos")
STAGE_KINDS = ("llm", "diffusion", "null")
BATCH_POLICIES = ("request", "refill")
BATCH_LEVELS = ("step", "request")
ROUTINGS = ("cost", "count")  # engine/routing.py
ATTENTION_BACKENDS = ("sdpa", "xformers", "fp8")
CHANNELS_LAST_MODES = ("auto", "on", "off")
LOAD_FORMATS = ("auto", "dummy")  # the weights on disk, or random ones of the same architecture
# the denoisers' linear layers: in the weights' dtype, or FP8 matmuls (stages/diffusion/fp8.py)
QUANTIZATIONS = ("none", "fp8")


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
                raise ConfigError(f"fault rule {text!r}: expected key=value, got {part!r}")
            fields[key.strip()] = value.strip()
        unknown = set(fields) - {"stage", "point", "kind", "match", "p", "seed"}
        if unknown:
            raise ConfigError(f"fault rule {text!r}: unknown keys {sorted(unknown)}")
        for key in ("stage", "point", "kind"):
            if key not in fields:
                raise ConfigError(f"fault rule {text!r}: missing {key}=")
        if fields["point"] not in FAULT_POINTS:
            raise ConfigError(f"fault rule {text!r}: point must be one of {FAULT_POINTS}")
        if fields["kind"] not in FAULT_KINDS:
            raise ConfigError(f"fault rule {text!r}: kind must be one of {FAULT_KINDS}")
        at_store, kind = fields["point"] == "store", fields["kind"]
        if (at_store and kind not in ("enospc", "raise")) or (kind == "enospc" and not at_store):
            raise ConfigError(
                f"fault rule {text!r}: point=store takes kind=enospc or kind=raise, "
                "and kind=enospc only point=store"
            )
        if fields["point"] == "store" and fields["stage"] not in STORES:
            raise ConfigError(f"fault rule {text!r}: point=store needs stage= one of {STORES}")
        try:
            p = float(fields["p"]) if "p" in fields else None
            seed = int(fields.get("seed", "0"))
        except ValueError:
            raise ConfigError(f"fault rule {text!r}: p and seed must be numbers") from None
        if p is not None and not 0.0 <= p <= 1.0:
            raise ConfigError(f"fault rule {text!r}: p must be within [0, 1]")
        return cls(
            stage=fields["stage"],
            point=fields["point"],
            kind=fields["kind"],
            match=fields.get("match"),
            p=p,
            seed=seed,
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


def _device_name(stage: str, device: object) -> str:
    """A `devices` entry: a GPU index (0 or "0" is cuda:0), "cuda:N" or "cpu"."""
    text = str(device).strip()
    if text.isdigit():
        return f"cuda:{text}"
    if text == "cpu" or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise ConfigError(
        f"stage {stage!r}: devices entry {device!r} is not a GPU index, cuda:N or cpu"
    )


COLD_STEP_FACTOR = 2.0  # a cold replica's first step may take twice the stall timeout


@dataclass(frozen=True)
class StageConfig:
    """One stage of a pipeline: what runs, where, and how many replicas."""

    name: str
    kind: str
    model: str = ""  # local directory, or an embedded name such as "tiny-image"
    load_format: str = "auto"  # auto | dummy (same architecture, random weights)
    dtype: str = "auto"  # auto | fp32 | fp16 | bf16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # one replica per entry ("cuda:N" or "cpu"; a bare N is cuda:N); replicas default to as many
    devices: tuple[str, ...] = ()
    gpu_memory_fraction: float | None = None  # of its GPU's memory each worker may take
    replicas: int = 1
    workers_per_replica: int = 1
    # the two guidance branches of each denoising step on two ranks (two devices) of one
    # replica (parallel/cfg_parallel.py): 2 workers per replica, devices taken two by two
    cfg_parallel: bool = False
    # one request's denoiser forwards over N ranks (N devices) of one replica, each holding 1/N
    # of the latent tokens (parallel/sequence_parallel.py, Ulysses attention): N workers per
    # replica, devices taken N by N (with cfg_parallel: 2N, a group of N a branch); 1: off
    sequence_parallel: int = 1
    max_batch_size: int = 8
    # when an idle replica takes its next batch (engine/batching.py): "request" waits up to
    # `batch_max_wait` seconds from the oldest queued request for a full batch; "refill" waits
    # after a batch up to `batch_wait` x its run time for the batch's clients to come back
    batch_policy: str = "request"
    batch_wait: float = 0.1
    batch_max_wait: float = 0.0
    # batches a replica may hold queued at its worker beyond the one it runs, and how a batch
    # picks its replica (engine/routing.py): by the work each holds ("cost") or its requests
    replica_queue: int = 0
    routing: str = "cost"
    # "step": a stage that steps rows runs a running set requests join and leave at step
    # boundaries (executor/running_set.py); "request": each batch runs whole (no joins)
    batch_level: str = "step"
    # shape groups a replica's running set interleaves, a step at a time (the age rule)
    shape_groups: int = 2
    # a running set's finished rows decode in groups: once this many rows ended, or the first
    # of them ended this long ago (or the set drained), whichever comes first
    decode_group_rows: int = 8
    decode_group_ms: float = 100.0
    stall_timeout: float = 60.0
    # a step during which the worker compiles or warms up (torch.compile reports both ends)
    compile_timeout: float = 600.0
    # a step on a replica that has measured none yet; None: COLD_STEP_FACTOR x stall_timeout
    cold_step_timeout: float | None = None
    load_timeout: float = 600.0
    # speed options of the diffusion stages (the denoiser): see stages/diffusion/acceleration.py
    compile: bool = False
    compile_mode: str = "default"
    attention: str = "sdpa"  # sdpa | xformers (falls back to sdpa, with a warning) | fp8
    channels_last: str = "auto"  # auto (on for a compiled conv UNet on CUDA) | on | off
    warmup_sizes: tuple[str, ...] = ()  # "WxH" the compiled denoiser is warmed up for
    batch_buckets: tuple[int, ...] = ()  # images per call compiled for (default: 1,2,4,8,...)
    batched_cfg: bool = True  # both guidance halves in one forward where a pipeline runs two
    # "fp8": the denoisers' linear layers (their family's) run rowwise FP8 matmuls (fp8.py)
    quantization: str = "none"
    # "idle-expert": a two-expert model's (Wan2.2-A14B) expert not in use waits in pinned host
    # memory, one expert on the device (stages/diffusion/offload.py; speed_settings.py)
    offload: str = "none"
    # compile each repeated block of the denoiser on its own (one graph a kind of block, reused
    # by all of them) instead of the whole denoiser: "auto" does so with fp8 or a step cache
    regional_compile: str = "auto"
    # a step cache of our own loop's rows, its threshold (None: its decision's) and decision
    cache: str = "none"
    cache_threshold: float | None = None
    cache_decision: str = "lagged"
    # with compile: each bucket's denoiser forward a CUDA graph (compile_choices.py)
    cuda_graphs: str = "auto"
    compile_text_encoders: str = "auto"  # with compile: the text encoders too (compile_choices)
    # with compile: where compiled graphs persist across starts and restarts ("": the cache
    # dir's inductor/, or TORCHINDUCTOR_CACHE_DIR; `serve`: <storage dir>/compile-cache)
    compile_cache: str = ""
    # a batch's VAE decode on the worker's finisher thread (a second CUDA stream), beside steps
    decode_overlap: bool = True
    # LoRA adapters (loras.py): registered, and `lora_dir`'s at run time; a pool of `max_loras`
    loras: tuple[LoraSpec, ...] = ()
    lora_dir: str | None = None
    max_loras: int = 8
    max_lora_rank: int = 64
    max_loras_per_request: int = PER_REQUEST  # a row's adapters: its slot tensor's width
    # what a request may ask of the model; None: the model's own (models/limits.py)
    max_side: int | None = None
    max_pixels: int | None = None
    max_frames: int | None = None
    max_steps: int | None = None
    # given as a mapping (YAML, the catalog); typed per kind once built (stage_options.py)
    options: Any = field(default_factory=dict)

    @property
    def leads(self) -> bool:
        """Whether a replica's rank 0 leads its other ranks (CFG-parallel, sequence parallel):
        it alone runs batches, and they serve the denoiser calls it hands them."""
        return self.cfg_parallel or self.sequence_parallel > 1

    @property
    def cold_timeout(self) -> float:
        """The stall bound of a step before the replica has measured any (engine/stall.py)."""
        if self.cold_step_timeout is not None:
            return self.cold_step_timeout
        return COLD_STEP_FACTOR * self.stall_timeout

    def __post_init__(self) -> None:
        devices = tuple(_device_name(self.name, d) for d in (self.devices or ()))
        object.__setattr__(self, "devices", devices)
        if self.cfg_parallel:
            self._check_cfg_parallel(devices)
        self._check_sequence_parallel(devices)
        if devices and self.replicas == 1:  # the default: one replica per device (group)
            ranks = self.workers_per_replica if self.leads else 1
            object.__setattr__(self, "replicas", max(1, len(devices) // ranks))
        fraction = self.gpu_memory_fraction
        if fraction is not None and not 0.0 < fraction <= 1.0:
            raise ConfigError(
                f"stage {self.name!r}: gpu_memory_fraction must be within (0, 1], not {fraction}"
            )
        if not isinstance(self.kind, str):  # YAML reads a bare `kind: null` as nothing
            raise ConfigError(
                f"stage {self.name!r}: kind must be one of {STAGE_KINDS} or 'module:Class', "
                f"not {self.kind!r} (in YAML, write kind: 'null')"
            )
        if self.kind not in STAGE_KINDS and ":" not in self.kind:
            raise ConfigError(
                f"stage {self.name!r}: kind must be one of {STAGE_KINDS} or 'module:Class'"
            )
        object.__setattr__(self, "options", parse_options(self.kind, self.name, self.options))
        if self.replicas < 1 or self.workers_per_replica < 1 or self.max_batch_size < 1:
            raise ConfigError(f"stage {self.name!r}: replicas and sizes must be >= 1")
        self._check_choices()
        self._check_batching()
        sizes = (self.max_loras, self.max_lora_rank, self.max_loras_per_request)
        where = (self.name, self.kind, self.loras, self.lora_dir)
        object.__setattr__(self, "loras", check_loras(*where, *sizes))
        for key in ("max_side", "max_pixels", "max_frames", "max_steps"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"stage {self.name!r}: {key} must be an integer >= 1")
        if any(int(b) < 1 for b in self.batch_buckets):
            raise ConfigError(f"stage {self.name!r}: batch buckets must be >= 1")
        for size in self.warmup_sizes:
            try:
                parse_size(size)
            except ValueError as exc:
                raise ConfigError(f"stage {self.name!r}: warmup {exc}") from None

    def _check_choices(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"stage {self.name!r}: load_format must be auto or dummy")
        check_compile(self)
        for key, value, allowed in (
            ("compile_mode", self.compile_mode, COMPILE_MODES),
            ("attention", self.attention, ATTENTION_BACKENDS),
            ("channels_last", self.channels_last, CHANNELS_LAST_MODES),
            ("routing", self.routing, ROUTINGS),
            ("batch_level", self.batch_level, BATCH_LEVELS),
            ("quantization", self.quantization, QUANTIZATIONS),
            ("regional_compile", self.regional_compile, REGIONAL_COMPILE_MODES),
            ("cuda_graphs", self.cuda_graphs, CUDA_GRAPHS_MODES),
        ):
            if value not in allowed:
                raise ConfigError(
                    f"stage {self.name!r}: {key} must be one of {', '.join(allowed)}, not {value!r}"
                )
        check_speed(self)

    @property
    def regional(self) -> bool:
        """Whether a compiled denoiser is compiled block by block (`regional_compile`)."""
        if self.regional_compile == "auto":
            return self.quantization == "fp8" or self.cache != "none"
        return self.regional_compile == "on"

    def _check_batching(self) -> None:
        if self.batch_policy not in BATCH_POLICIES:
            raise ConfigError(
                f"stage {self.name!r}: batch_policy must be one of {', '.join(BATCH_POLICIES)}"
            )
        if not isinstance(self.replica_queue, int) or self.replica_queue < 0:
            raise ConfigError(f"stage {self.name!r}: replica_queue must be an integer >= 0")
        if self.decode_group_rows < 1 or self.decode_group_ms < 0:
            raise ConfigError(
                f"stage {self.name!r}: decode_group_rows must be >= 1, decode_group_ms >= 0"
            )
        if not isinstance(self.shape_groups, int) or self.shape_groups < 1:
            raise ConfigError(f"stage {self.name!r}: shape_groups must be an integer >= 1")
        if self.batch_max_wait < 0:
            raise ConfigError(f"stage {self.name!r}: batch_max_wait must be >= 0")
        if not 0.0 <= self.batch_wait <= 1.0:
            raise ConfigError(f"stage {self.name!r}: batch_wait must be within [0, 1]")

    def _check_cfg_parallel(self, devices: tuple[str, ...]) -> None:
        where = f"stage {self.name!r}: cfg_parallel"
        if self.kind != "diffusion" and ":" not in self.kind:  # or the user's own Stage
            raise ConfigError(f"{where} runs diffusion stages only, not {self.kind!r}")
        if self.workers_per_replica not in (1, 2, 2 * self.sequence_parallel):  # (2 x N: its)
            raise ConfigError(f"{where} runs 2 workers per replica")
        object.__setattr__(self, "workers_per_replica", 2)
        if len(devices) % 2:
            raise ConfigError(f"{where} takes devices two by two, not {len(devices)}")
        for pair in zip(devices[::2], devices[1::2], strict=True):
            if pair[0] == pair[1] and pair[0] != "cpu":
                raise ConfigError(f"{where}: the two ranks need two GPUs, not {pair}")

    def _check_sequence_parallel(self, devices: tuple[str, ...]) -> None:
        n = self.sequence_parallel
        where = f"stage {self.name!r}: sequence_parallel"
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"{where} must be an integer >= 1 (ranks per replica), not {n!r}")
        if n == 1:
            return
        ranks = 2 * n if self.cfg_parallel else n  # (with CFG-parallel: a group of n a branch)
        if self.kind != "diffusion" and ":" not in self.kind:  # or the user's own Stage
            raise ConfigError(f"{where} runs diffusion stages only, not {self.kind!r}")
        if self.workers_per_replica not in (1, 2 if self.cfg_parallel else n, ranks):
            raise ConfigError(f"{where} {n} runs {ranks} workers per replica")
        object.__setattr__(self, "workers_per_replica", ranks)
        # every rank decodes (a patch-parallel VAE) as it denoises: on the main thread, between
        # steps, where the ranks' exchanges keep one order - not beside the next steps
        object.__setattr__(self, "decode_overlap", False)
        if not devices and self.device != "cpu":
            raise ConfigError(
                f"{where} {n}: a replica's {ranks} ranks need {ranks} devices: name them with "
                f"--devices (devices: in YAML), {ranks} per replica, or run on --device cpu"
            )
        if len(devices) % ranks:
            raise ConfigError(f"{where} {n} takes devices {ranks} by {ranks}, not {len(devices)}")
        for start in range(0, len(devices), ranks):
            group = devices[start : start + ranks]
            gpus = [d for d in group if d != "cpu"]
            if 0 < len(gpus) < ranks:
                raise ConfigError(f"{where} {n}: a replica's ranks are all GPUs or all CPU")
            if len(set(gpus)) != len(gpus):
                raise ConfigError(f"{where} {n}: a replica's ranks need {ranks} GPUs, not {group}")


def parse_size(text: str) -> tuple[int, int]:
    """'WxH' -> (width, height); ValueError otherwise."""
    w, sep, h = str(text).lower().partition("x")
    if not sep or not w.isdigit() or not h.isdigit() or int(w) <= 0 or int(h) <= 0:
        raise ValueError(f"size must be 'WIDTHxHEIGHT', not {text!r}")
    return int(w), int(h)


@dataclass(frozen=True)
class PipelineConfig:
    """A named chain of stages, each fed the output of the one before (pipelines/base.py says
    how: an LLM's text becomes the next stage's prompt); `output` is what its last one makes."""

    name: str
    stages: tuple[StageConfig, ...]
    output: str = "image"  # image | video


@dataclass(frozen=True)
class Limits:
    """Server-wide request limits (over one is 400, 413 for bytes). What may be asked of a
    model (sizes, frames, steps) is the model's own: StageConfig.max_* and models/limits.py."""

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
    header_timeout: float = 10.0  # a request's headers must arrive within this
    body_timeout: float = 60.0  # and its whole body within this after the headers
    limits: Limits = field(default_factory=Limits)


@dataclass(frozen=True)
class EngineConfig:
    pipelines: tuple[PipelineConfig, ...]
    max_restarts: int = 3
    max_request_retries: int = 1
    request_timeout: float = 600.0
    max_queue_size: int = 256
    # work admitted per pipeline, in seconds at the replicas' measured speed (cost.py)
    max_queue_seconds: float = 300.0
    faults: tuple[FaultRule, ...] = ()
    executor: str = "multiproc"  # multiproc | ray: how every stage's workers run
    ray_address: str | None = None  # with ray: an existing cluster to join (None: local)
