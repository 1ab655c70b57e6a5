"""Which family runs a model directory: chosen once from model_index.json, torch-free; any other
diffusers pipeline gets the generic adapter with what its configs say."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from vllm_omni_like.models.limits import describe_stage
from vllm_omni_like.models.registry import (
    ARCHITECTURES,
    FAMILIES,
    family_for,
    family_of,
    loops_for,
)
from vllm_omni_like.pipelines.catalog import ARCH_OPTIONS, arch_path, resolve

IMAGE_VAE = {"block_out_channels": [128, 256, 512, 512]}
VIDEO_VAE = {"scale_factor_spatial": 8, "scale_factor_temporal": 4}


def test_each_family_claims_its_pipelines():
    for family in FAMILIES:
        for name in family.pipelines:
            index = {"_class_name": name}
            if family.config_flag:  # (told apart from its class's other family by a flag)
                index[family.config_flag] = True
            assert family_for(index) is family
    assert family_for({"_class_name": "WanPipeline", "expand_timesteps": False}).name == "wan"
    assert family_of(arch_path("sd15")).name == "stable-diffusion"
    xl = family_of(arch_path("sdxl"))  # the UNet family's second member
    assert (xl.name, xl.default_guidance, xl.schedulers) == (
        "stable-diffusion-xl",
        5.0,
        family_of(arch_path("sd15")).schedulers,
    )
    wan = family_of(arch_path("wan2.1-t2v-1.3b"))
    assert (wan.name, wan.output, wan.size_base) == ("wan", "video", 16)
    assert wan.vae_factors(VIDEO_VAE) == (8, 4)


def test_each_shipped_architecture_has_its_preset_in_the_family_that_serves_it():
    """The presets live on the family a shipped config's model_index.json picks (none left
    over), repeat none of the family's defaults, and the catalog serves them with its
    guidance filled in."""
    assert sorted(ARCHITECTURES) == sorted(os.listdir(arch_path("")))
    for arch, family in ARCHITECTURES.items():
        assert family_of(arch_path(arch)) is family
        assert family.presets[arch].get("default_guidance") != family.default_guidance
        assert ARCH_OPTIONS[arch] == {"default_guidance": family.default_guidance} | dict(
            family.presets[arch]
        )
    assert ARCH_OPTIONS["wan2.2-t2v-a14b"]["default_guidance"] == 4.0  # its own
    assert ARCH_OPTIONS["wan2.1-t2v-1.3b"]["default_guidance"] == 5.0  # the family's
    assert ARCH_OPTIONS["flux.1-schnell"]["default_guidance"] == 0.0  # no guidance


def test_another_pipeline_gets_the_generic_adapter_with_what_its_configs_say():
    pixart = family_for({"_class_name": "PixArtAlphaPipeline"}, IMAGE_VAE)
    assert (pixart.name, pixart.output, pixart.size_base) == ("generic", "image", 8)
    assert (pixart.own_loop, pixart.schedulers) == ((), ())  # the pipeline's call, its scheduler
    assert pixart.vae_factors(IMAGE_VAE) == (8, None)
    assert pixart.adapter.endswith("generic.adapter")
    cog = family_for({"_class_name": "CogVideoXPipeline"}, {"block_out_channels": [1, 2, 3, 4]})
    assert cog.output == "video" and cog.default_guidance == 5.0
    vace = family_for({"_class_name": "WanVACEPipeline"}, VIDEO_VAE)  # no adapter yet
    assert (vace.name, vace.output, vace.size_base) == ("generic", "video", 16)
    assert family_for({}).name == "generic"


def test_a_directory_without_its_configs_is_generic(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "PixArtAlphaPipeline"}))
    assert family_of(str(tmp_path)).name == "generic"
    assert loops_for(str(tmp_path)) == {
        "text2img": (
            "pipeline",
            "generic (a diffusers pipeline no family claims): text2img runs the pipeline's call",
        ),
        "edit": (
            "pipeline",
            "generic (a diffusers pipeline no family claims): edit runs the pipeline's call",
        ),
    }


def _model(tmp_path, pipeline: str, scheduler: str, **config) -> str:
    index = {"_class_name": pipeline, "scheduler": ["diffusers", scheduler]}
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    (tmp_path / "scheduler").mkdir()
    (tmp_path / "scheduler" / "scheduler_config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_each_mode_says_which_loop_runs_it_and_why_not_our_own(tmp_path):
    assert loops_for(arch_path("sd15")) == {
        "text2img": ("own", None),
        "edit": ("own", None),  # (image to image)
        "inpaint": ("own", None),
    }
    assert loops_for(arch_path("sdxl"))["text2img"] == ("own", None)  # (Euler: its own)
    assert loops_for(arch_path("qwen-image-edit")) == {"edit": ("own", None)}  # (instructions)
    every = {mode: ("own", None) for mode in ("text2img", "edit", "inpaint")}
    assert loops_for(arch_path("qwen-image")) == every  # (img2img, inpainting: #55)
    assert loops_for(arch_path("z-image-turbo")) == every
    for i2v in ("wan2.1-i2v-14b", "wan2.2-i2v-a14b"):
        assert loops_for(arch_path(i2v)) == {"image2video": ("own", None)}
    ti2v = {"text2video": ("own", None), "image2video": ("own", None)}
    assert loops_for(arch_path("wan2.2-ti2v-5b")) == ti2v  # (one shape group)
    assert loops_for(arch_path("wan2.1-t2v-1.3b")) == {"text2video": ("own", None)}
    # (a replica of several ranks runs the same loops: CFG-parallel, sequence parallel)
    served = resolve("tiny-video", cfg_parallel=True, devices=(0, 1))[0].stages[-1]
    assert describe_stage(served)["loops"] == {"text2video": "own"}
    # (schedulers whose steps draw noise, keep three outputs or warm up by Runge-Kutta: ours)
    for i, (scheduler, config) in enumerate(
        [
            ("DPMSolverMultistepScheduler", {"algorithm_type": "sde-dpmsolver++"}),
            ("DPMSolverMultistepScheduler", {"solver_order": 3}),
            ("UniPCMultistepScheduler", {"solver_order": 3}),
            ("PNDMScheduler", {"skip_prk_steps": False}),
        ]
    ):
        (tmp_path / str(i)).mkdir()
        own = _model(tmp_path / str(i), "StableDiffusionPipeline", scheduler, **config)
        assert loops_for(own)["text2img"] == ("own", None), (scheduler, config)
    sde = _model(tmp_path, "StableDiffusionPipeline", "DPMSolverMultistepScheduler",
                 algorithm_type="sde-dpmsolver")  # fmt: skip
    assert loops_for(sde)["text2img"] == (
        "pipeline",
        "the model's scheduler: DPMSolverMultistepScheduler with sde-dpmsolver (its SDE solver "
        "runs as sde-dpmsolver++)",
    )


def test_the_registry_and_limits_do_not_import_torch():
    code = (
        "import sys; import vllm_omni_like.models.registry, vllm_omni_like.models.limits; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
