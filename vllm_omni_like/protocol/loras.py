"""A request's LoRA adapters: its `lora` list and a `model: "base:adapter"`, each name checked
against what the pipeline's diffusion stage serves (vllm_omni_like/loras.py) before anything is
queued: an unknown one is a 400 naming it."""

from __future__ import annotations

from typing import Any

from vllm_omni_like.config import StageConfig
from vllm_omni_like.engine import AsyncOmni
from vllm_omni_like.errors import InvalidRequestError
from vllm_omni_like.loras import resolve, served
from vllm_omni_like.params import LoraRef


def split_model(engine: AsyncOmni, model: str | None) -> tuple[str | None, str | None]:
    """(pipeline, adapter) of a request's `model`: "base:adapter" names an adapter of a
    served pipeline `base`; a served name (or none) names none."""
    if model is None or model in engine.pipeline_names or ":" not in model:
        return model, None
    base, _, adapter = model.rpartition(":")
    return base, adapter


def lora_stage(engine: AsyncOmni, pipeline: str) -> StageConfig | None:
    """The pipeline's stage that takes LoRA adapters (None: none does)."""
    stages = engine.config_of(pipeline).stages
    return next((s for s in stages if s.loras or s.lora_dir is not None), None)


def served_adapters(engine: AsyncOmni, pipeline: str) -> list[str]:
    """The adapter names a pipeline answers to now (`/v1/models` lists `base:adapter`)."""
    stage = lora_stage(engine, pipeline)
    return [] if stage is None else served(stage.loras, stage.lora_dir)


def lora_refs(
    engine: AsyncOmni, pipeline: str, items: list[Any] | None, named: str | None
) -> tuple[LoraRef, ...]:
    """The request's adapters (`model: base:adapter` first, at scale 1), each served by the
    pipeline: else a 400 naming it."""
    refs = [LoraRef(named)] if named is not None else []
    refs += [LoraRef(item.name, item.scale) for item in items or []]
    if not refs:
        return ()
    stage = lora_stage(engine, pipeline)
    if stage is not None and len(refs) > stage.max_loras_per_request:
        raise InvalidRequestError(
            f"a request takes at most {stage.max_loras_per_request} LoRA adapters "
            f"(--max-loras-per-request), not {len(refs)}",
            param="lora",
        )
    names = [r.name for r in refs]
    if len(set(names)) < len(names):
        raise InvalidRequestError("a LoRA adapter is named twice", param="lora")
    for ref in refs:
        if stage is None or resolve(ref.name, stage.loras, stage.lora_dir) is None:
            raise InvalidRequestError(
                f"unknown LoRA adapter {ref.name!r} for model {pipeline!r}",
                param="model" if ref.name == named else "lora",
                code="lora_not_found",
            )
    return tuple(refs)
