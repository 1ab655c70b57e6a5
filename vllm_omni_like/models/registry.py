"""Which family runs a model directory: chosen once, from its `model_index.json`."""

from __future__ import annotations

import json
import os
from typing import Any

from vllm_omni_like.models import flux, qwen_image, sd3, stable_diffusion, wan, z_image
from vllm_omni_like.models.family import Config, Family, Loop
from vllm_omni_like.models.generic import generic_family
from vllm_omni_like.models.schedulers import unsupported
from vllm_omni_like.wire import Mode

FAMILIES: tuple[Family, ...] = (
    stable_diffusion.FAMILY,
    stable_diffusion.XL_FAMILY,
    sd3.FAMILY,
    flux.FAMILY,
    qwen_image.FAMILY,
    qwen_image.EDIT_FAMILY,
    z_image.FAMILY,
    wan.TI2V_FAMILY,
    wan.FAMILY,
    wan.I2V_FAMILY,
)
# the architecture configs shipped without weights (assets/archs, for benchmarks) by name: the
# family that serves each (its `presets` hold the options it is served with)
ARCHITECTURES: dict[str, Family] = {arch: f for f in FAMILIES for arch in f.presets}


def read_config(path: str, *parts: str) -> Config:
    file = os.path.join(path, *parts)
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        config: dict[str, Any] = json.load(f)
    return config


def family_for(index: Config, vae: Config | None = None) -> Family:
    """The family of a pipeline whose model_index.json is `index` (its VAE's config: `vae`)."""
    name = str(index.get("_class_name", ""))
    for family in FAMILIES:  # (a family with a `config_flag` before its class's other one)
        if name in family.pipelines and (
            family.config_flag is None or index.get(family.config_flag)
        ):
            return family
    return generic_family(name, vae or {})


def family_of(path: str) -> Family:
    """The family of the diffusers directory `path`."""
    return family_for(
        read_config(path, "model_index.json"), read_config(path, "vae", "config.json")
    )


def denoiser_config(path: str, index: Config) -> Config:
    """The config of the model's denoiser (its transformer's, or its UNet's)."""
    return read_config(path, "transformer" if "transformer" in index else "unet", "config.json")


def model_modes(path: str) -> tuple[Mode, ...]:
    """The modes the model at `path` runs (`Family.modes_of`: its family's, or inpainting
    alone for a denoiser that takes a mask), the first its generation's."""
    index = read_config(path, "model_index.json")
    vae = read_config(path, "vae", "config.json")
    return family_for(index, vae).modes_of(denoiser_config(path, index), vae)


def loops_for(path: str) -> dict[Mode, tuple[Loop, str | None]]:
    """Per mode of the model at `path`: which denoising loop its batches run, "own" or
    "pipeline" (the diffusers pipeline's call), and why not our own (None where it is).
    The API process (batching, `/health`, `/metrics`) and the worker decide alike; a replica
    of several ranks (CFG-parallel, sequence parallel) runs the same loops as one."""
    family = family_of(path)
    index = read_config(path, "model_index.json")
    scheduler = str((index.get("scheduler") or [None, ""])[1])
    problem = unsupported(scheduler, read_config(path, "scheduler", "scheduler_config.json"))
    loops: dict[Mode, tuple[Loop, str | None]] = {}
    for mode in model_modes(path):
        why = None
        if mode not in family.own_loop:  # (every mode of the generic family: its own call is
            # the only loop known for a pipeline no family claims)
            what = " (a diffusers pipeline no family claims)" if family.name == "generic" else ""
            why = f"{family.name}{what}: {mode} runs the pipeline's call"
        elif problem is not None:
            why = f"the model's scheduler: {problem}"
        loops[mode] = ("pipeline", why) if why else ("own", None)
    return loops
