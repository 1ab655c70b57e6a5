"""The named pipelines: embedded defaults, null pipelines, local directories and YAML files."""

from __future__ import annotations

import os
from dataclasses import replace
from importlib import resources
from typing import Any

import yaml

from vllm_omni_like.config import PipelineConfig, StageConfig
from vllm_omni_like.errors import ConfigError
from vllm_omni_like.models.registry import family_of
from vllm_omni_like.shapes.world import OUTSIDE, caption_grammar, describe

# how the embedded models were trained (training/): the rewriter reads "<prompt> <sep>" and
# answers "<outside>" alone to a prompt that names nothing its world draws;
# the image model draws 64x64 (and up to twice that, the default limit); the video model was
# trained on 64x64 clips of 9 to 33 frames, at 8 fps 4 seconds at most
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


WAN_720P = {
    "default_width": 1280,
    "default_height": 720,
    "default_frames": 81,
    "max_side": 1280,
    "max_frames": 81,
    "default_fps": 16,
    "max_sequence_length": 512,
}
# architecture configs shipped without weights (vllm_omni_like/assets/archs, for benchmarks)
ARCH_OPTIONS: dict[str, dict[str, Any]] = {
    "sd15": {"default_steps": 30, "default_guidance": 7.5},
    "sdxl": {"default_steps": 30, "default_guidance": 5.0},
    # the MMDiTs at their published defaults (1024x1024 from their VAE's config)
    "flux.1-dev": {"default_steps": 28, "default_guidance": 3.5},
    "flux.1-schnell": {"default_steps": 4, "default_guidance": 0.0},
    "sd3.5-medium": {"default_steps": 40, "default_guidance": 4.5},
    "sd3.5-large": {"default_steps": 28, "default_guidance": 3.5},
    "qwen-image": {"default_steps": 50, "default_guidance": 4.0},
    "qwen-image-edit": {"default_steps": 50, "default_guidance": 4.0},
    "z-image-turbo": {"default_steps": 9, "default_guidance": 0.0},  # its published use
    "wan2.1-t2v-1.3b": {
        "default_width": 832,
        "default_height": 480,
        "default_frames": 33,
        "max_side": 1280,  # 720p, the largest it was trained for
        "max_frames": 81,
        "default_steps": 20,
        "default_guidance": 5.0,
        "max_sequence_length": 512,
    },
    # 720p, 81 frames at 16 fps (Wan2.2-A14B: its high-noise expert's scale; the low-noise
    # one's 3.0 is not served: one scale a request)
    "wan2.1-t2v-14b": {**WAN_720P, "default_steps": 50, "default_guidance": 5.0},
    "wan2.2-t2v-a14b": {**WAN_720P, "default_steps": 40, "default_guidance": 4.0},
    # image to video at 720p, as published: Wan2.1-I2V-14B-720P 50 steps at CFG 5, Wan2.2-I2V-A14B
    # 40 steps at CFG 3.5 for both experts
    "wan2.1-i2v-14b": {**WAN_720P, "default_steps": 50, "default_guidance": 5.0},
    "wan2.2-i2v-a14b": {**WAN_720P, "default_steps": 40, "default_guidance": 3.5},
    # 1280x704, 121 frames at 24 fps
    "wan2.2-ti2v-5b": {
        "default_width": 1280,
        "default_height": 704,
        "default_frames": 121,
        "max_side": 1280,
        "max_frames": 121,
        "default_fps": 24,
        "default_steps": 50,
        "default_guidance": 5.0,
        "max_sequence_length": 512,
    },
}


def arch_path(name: str) -> str:
    return str(resources.files("vllm_omni_like") / "assets" / "archs" / name)


def _for_kind(kind: str, kw: dict[str, Any]) -> dict[str, Any]:
    """The overrides of every stage that apply to a stage of `kind` (CFG-parallel: diffusion)."""
    return kw if kind == "diffusion" else {k: v for k, v in kw.items() if k != "cfg_parallel"}


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
