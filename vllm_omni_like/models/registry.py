"""Which family runs a model directory: chosen once, from its `model_index.json`."""

from __future__ import annotations

import json
import os

from vllm_omni_like.models import stable_diffusion, wan
from vllm_omni_like.models.family import Config, Family
from vllm_omni_like.models.generic import generic_family

FAMILIES: tuple[Family, ...] = (stable_diffusion.FAMILY, wan.FAMILY)


def read_config(path: str, *parts: str) -> Config:
    file = os.path.join(path, *parts)
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        return json.load(f)


def family_for(index: Config, vae: Config | None = None) -> Family:
    """The family of a pipeline whose model_index.json is `index` (its VAE's config: `vae`)."""
    name = str(index.get("_class_name", ""))
    for family in FAMILIES:
        if name in family.pipelines:
            return family
    return generic_family(name, vae or {})


def family_of(path: str) -> Family:
    """The family of the diffusers directory `path`."""
    return family_for(
        read_config(path, "model_index.json"), read_config(path, "vae", "config.json")
    )
