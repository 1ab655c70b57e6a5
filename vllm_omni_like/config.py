"""Frozen configuration: the one place where environment variables and config files are read."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from vllm_omni_like.errors import InvalidRequestError

FAULTS_ENV = "VLLM_OMNI_LIKE_FAULTS"
CACHE_ENV = "VLLM_OMNI_LIKE_CACHE"

FAULT_POINTS = ("load", "execute", "step", "output")
FAULT_KINDS = ("raise", "invalid", "oom", "exit", "hang")
STAGE_KINDS = ("llm", "diffusion", "null")


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
    stall_timeout: float = 60.0
    load_timeout: float = 600.0
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


@dataclass(frozen=True)
class PipelineConfig:
    """A named chain of stages; `kind` says how one stage's output feeds the next."""

    name: str
    stages: tuple[StageConfig, ...]
    output: str = "image"  # image | video


@dataclass(frozen=True)
class EngineConfig:
    pipelines: tuple[PipelineConfig, ...]
    max_restarts: int = 3
    max_request_retries: int = 1
    request_timeout: float = 600.0
    max_queue_size: int = 256
    faults: tuple[FaultRule, ...] = ()
