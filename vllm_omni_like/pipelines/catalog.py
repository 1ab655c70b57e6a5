"""The named pipelines: embedded defaults, null pipelines, local directories and YAML files."""

from __future__ import annotations

import os
from dataclasses import replace
from importlib import resources
from typing import Any

import yaml

from vllm_omni_like.config import PipelineConfig, StageConfig
from vllm_omni_like.errors import ConfigError
from vllm_omni_like.models.registry import ARCHITECTURES, family_of
from vllm_omni_like.shapes.world import OUTSIDE, caption_grammar, describe

# how the embedded models were trained (training/): settings of these weights and of the shapes
# world they learned, not of their families (models/), so they stay with the named pipelines.
# The rewriter reads "<prompt> <sep>" and answers "<outside>" alone to a prompt that names
# nothing its world draws; the image model draws 64x64 (and up to twice that, the default
# limit); the video model was trained on 64x64 clips of 9 to 33 frames, at 8 fps 4 seconds at
# most
TINY_OPTIONS: dict[str, dict[str, Any]] = {
    "tiny-llm": {
        "prompt_template": "{prompt} <sep>",
        "max_new_tokens": 24,
        "outside_answer": OUTSIDE,
        "outside_message": f"the prompt names nothing this model draws: it draws {describe()}",
        "output_grammar": caption_grammar(),
    },
    "tiny-image": {"default_guidance": 5.0},
    "tiny-video": {
        "default_guidance": 5.0,
        "default_steps": 20,
        "max_side": 64,
        "max_frames": 33,
        "default_fps": 8,
    },
}


# architecture configs shipped without weights (vllm_omni_like/assets/archs, for benchmarks):
# the options each is served with, its family's (models/<family>/__init__.py, `presets`)
ARCH_OPTIONS: dict[str, dict[str, Any]] = {
    name: family.preset(name) for name, family in ARCHITECTURES.items()
}


def arch_path(name: str) -> str:
    return str(resources.files("vllm_omni_like") / "assets" / "archs" / name)


DIFFUSION_ONLY = (
    "cfg_parallel",
    "sequence_parallel",
    "quantization",
    "offload",
    "loras",
    "lora_dir",
    "max_loras",
    "max_lora_rank",
    "max_loras_per_request",
    "cuda_graphs",
)  # overrides of every stage that only
# diffusion stages take (an LLM stage in front keeps its own)


def _for_kind(kind: str, kw: dict[str, Any]) -> dict[str, Any]:
    """The overrides of every stage that apply to a stage of `kind`."""
    return kw if kind == "diffusion" else {k: v for k, v in kw.items() if k not in DIFFUSION_ONLY}


def _stage(name: str, kind: str, model: str, kw: dict[str, Any]) -> StageConfig:
    options = {**TINY_OPTIONS.get(model, {}), **kw.pop("options", {})}
    return StageConfig(name=name, kind=kind, model=model, options=options, **_for_kind(kind, kw))


def _llm(model: str = "tiny-llm", **kw: Any) -> StageConfig:
    return _stage("llm", "llm", model, kw)


def _diffusion(model: str, **kw: Any) -> StageConfig:
    return _stage("diffusion", "diffusion", model, kw)


def _null(name: str, output: str, **kw: Any) -> StageConfig:
    options = {"output": output, **kw.pop("options", {})}
    return StageConfig(name=name, kind="null", options=options, **_for_kind("null", kw))


def builtin(name: str, **stage_kw: Any) -> PipelineConfig | None:
    """The pipelines every install has; `stage_kw` overrides every stage's fields."""
    table = {
        "tiny-omni": lambda: ((_llm(**stage_kw), _diffusion("tiny-image", **stage_kw)), "image"),
        "tiny-image": lambda: ((_diffusion("tiny-image", **stage_kw),), "image"),
        "tiny-video": lambda: ((_diffusion("tiny-video", **stage_kw),), "video"),
        "null-omni": lambda: (
            (_null("llm", "text", **stage_kw), _null("diffusion", "image", **stage_kw)),
            "image",
        ),
        "null-image": lambda: ((_null("diffusion", "image", **stage_kw),), "image"),
        "null-video": lambda: ((_null("diffusion", "video", **stage_kw),), "video"),
    }
    if name not in table:
        return None
    stages, output = table[name]()
    return PipelineConfig(name=name, stages=stages, output=output)


BUILTIN_NAMES = ("tiny-omni", "tiny-image", "tiny-video", "null-omni", "null-image", "null-video")


def from_directory(path: str, llm: str | None = None, **stage_kw: Any) -> PipelineConfig:
    """A local diffusers directory, optionally with a local LLM directory as prompt stage."""
    index_path = os.path.join(path, "model_index.json")
    if not os.path.exists(index_path):
        raise ConfigError(f"{path!r} is not a diffusers directory (no model_index.json)")
    output = family_of(path).output
    stages: tuple[StageConfig, ...] = (_diffusion(path, **stage_kw),)
    if llm:
        stages = (_llm(llm, **stage_kw), *stages)
    name = os.path.basename(os.path.normpath(path))
    return PipelineConfig(name=name, stages=stages, output=output)


def from_architecture(name: str, llm: str | None = None, **stage_kw: Any) -> PipelineConfig:
    """A shipped architecture config: the real model's shapes, random weights."""
    if stage_kw.get("load_format") != "dummy":
        raise ConfigError(
            f"{name!r} ships as an architecture config without weights: "
            "serve it with --load-format dummy (random weights)"
        )
    options = {**ARCH_OPTIONS[name], **stage_kw.pop("options", {})}
    pipeline = from_directory(arch_path(name), llm, options=options, **stage_kw)
    return replace(pipeline, name=name)


def from_yaml(path: str) -> list[PipelineConfig]:
    """Pipelines described in a YAML file (see examples/pipeline.yaml)."""
    with open(path) as f:
        doc = yaml.safe_load(f) or {}
    entries = doc.get("pipelines")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path}: expected a non-empty 'pipelines' list")
    result = []
    for entry in entries:
        try:
            stages = tuple(StageConfig(**stage) for stage in entry["stages"])
            result.append(
                PipelineConfig(
                    name=entry["name"], stages=stages, output=entry.get("output", "image")
                )
            )
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"{path}: bad pipeline entry {entry!r}: {exc}") from exc
    return result


def resolve(spec: str, llm: str | None = None, **stage_kw: Any) -> list[PipelineConfig]:
    """A built-in name, a YAML file or a diffusers directory -> pipeline configs."""
    found = builtin(spec, **stage_kw)
    if found is not None:
        return [found]
    if spec in ARCH_OPTIONS:
        return [from_architecture(spec, llm, **stage_kw)]
    if spec.endswith((".yaml", ".yml")) and os.path.isfile(spec):
        return [_override(p, stage_kw) for p in from_yaml(spec)]
    if os.path.isdir(spec):
        return [from_directory(spec, llm, **stage_kw)]
    raise ConfigError(
        f"unknown model {spec!r}: not a built-in pipeline ({', '.join(BUILTIN_NAMES)}), "
        f"an architecture ({', '.join(ARCH_OPTIONS)}), a YAML file or a local diffusers directory"
    )


def _override(pipeline: PipelineConfig, stage_kw: dict[str, Any]) -> PipelineConfig:
    if not stage_kw:
        return pipeline
    stages = tuple(replace(s, **_for_kind(s.kind, stage_kw)) for s in pipeline.stages)
    return replace(pipeline, stages=stages)
