"""Which family runs a model directory: chosen once from model_index.json, torch-free; any other
diffusers pipeline gets the generic adapter with what its configs say."""

from __future__ import annotations

import json
import subprocess
import sys

from vllm_omni_like.models.registry import FAMILIES, family_for, family_of
from vllm_omni_like.pipelines.catalog import arch_path

IMAGE_VAE = {"block_out_channels": [128, 256, 512, 512]}
VIDEO_VAE = {"scale_factor_spatial": 8, "scale_factor_temporal": 4}


def test_each_family_claims_its_pipelines():
    for family in FAMILIES:
        for name in family.pipelines:
            assert family_for({"_class_name": name}) is family
    assert family_of(arch_path("sd15")).name == "stable-diffusion"
    wan = family_of(arch_path("wan2.1-t2v-1.3b"))
    assert (wan.name, wan.output, wan.size_base) == ("wan", "video", 16)
    assert wan.vae_factors(VIDEO_VAE) == (8, 4)


def test_another_pipeline_gets_the_generic_adapter_with_what_its_configs_say():
    sdxl = family_for({"_class_name": "StableDiffusionXLPipeline"}, IMAGE_VAE)
    assert (sdxl.name, sdxl.output, sdxl.size_base, sdxl.loop) == (
        "generic",
        "image",
        8,
        "pipeline",
    )
    assert sdxl.vae_factors(IMAGE_VAE) == (8, None)
    assert sdxl.adapter.endswith("generic.adapter")
    cog = family_for({"_class_name": "CogVideoXPipeline"}, {"block_out_channels": [1, 2, 3, 4]})
    assert cog.output == "video" and cog.default_guidance == 5.0
    i2v = family_for({"_class_name": "WanImageToVideoPipeline"}, VIDEO_VAE)  # no adapter yet
    assert (i2v.name, i2v.output, i2v.size_base) == ("generic", "video", 16)
    assert family_for({}).name == "generic"


def test_a_directory_without_its_configs_is_generic(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    family = family_of(str(tmp_path))
    assert family.name == "generic" and family.describe() == {
        "family": "generic",
        "loop": "pipeline",
    }


def test_the_registry_and_limits_do_not_import_torch():
    code = (
        "import sys; import vllm_omni_like.models.registry, vllm_omni_like.models.limits; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
