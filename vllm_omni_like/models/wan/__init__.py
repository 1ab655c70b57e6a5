"""The Wan video families, torch-free (their adapters: models/wan/adapter.py, ti2v.py, i2v.py):
`wan` - text to video (Wan2.1-T2V, Wan2.2-T2V-A14B's two experts, the embedded tiny-video model);
`wan-ti2v` - Wan2.2-TI2V-5B, text to video or from a first frame (its pipeline class is
WanPipeline too: told apart by `expand_timesteps`); `wan-i2v` - image to video only
(WanImageToVideoPipeline: Wan2.1-I2V-14B with its CLIP image encoder, Wan2.2-I2V-A14B's two
experts without one)."""

from __future__ import annotations

import dataclasses

from vllm_omni_like.models.family import Config, Family
from vllm_omni_like.wire import Mode


def wan_vae_factors(vae: Config) -> tuple[int, int | None]:
    """AutoencoderKLWan says its factors (8 and 4 in Wan2.1's)."""
    return int(vae["scale_factor_spatial"]), int(vae["scale_factor_temporal"])


# 720p, 81 frames at 16 fps: the 14B models' published settings
WAN_720P = {
    "default_width": 1280,
    "default_height": 720,
    "default_frames": 81,
    "max_side": 1280,
    "max_frames": 81,
    "default_fps": 16,
    "max_sequence_length": 512,
}

FAMILY = Family(
    name="wan",
    pipelines=("WanPipeline",),
    output="video",
    size_base=16,  # WanPipeline.check_inputs
    default_guidance=5.0,
    adapter="vllm_omni_like.models.wan.adapter",
    fp8=True,
    fp8_attention=True,
    step_cache=True,
    vae_factors=wan_vae_factors,
    own_loop=(Mode.TEXT2VIDEO,),
    schedulers=("unipc", "flow-euler"),
    presets={
        "wan2.1-t2v-1.3b": {
            "default_width": 832,
            "default_height": 480,
            "default_frames": 33,
            "max_side": 1280,  # 720p, the largest it was trained for
            "max_frames": 81,
            "default_steps": 20,
            "max_sequence_length": 512,
        },
        "wan2.1-t2v-14b": {**WAN_720P, "default_steps": 50},
        # Wan2.2-A14B: its high-noise expert's scale (the low-noise one's published 3.0 is a
        # request's own `guidance_scale_2`; without it, this scale for both)
        "wan2.2-t2v-a14b": {**WAN_720P, "default_steps": 40, "default_guidance": 4.0},
    },
)

# its first frame given: as WanImageToVideoPipeline over the same models makes it, on our loop
# beside text rows (models/wan/ti2v.py)
TI2V_FAMILY = dataclasses.replace(
    FAMILY,
    name="wan-ti2v",
    adapter="vllm_omni_like.models.wan.ti2v",
    own_loop=(Mode.TEXT2VIDEO, Mode.IMAGE2VIDEO),
    video_from_image=True,
    config_flag="expand_timesteps",
    presets={  # 1280x704, 121 frames at 24 fps
        "wan2.2-ti2v-5b": {
            "default_width": 1280,
            "default_height": 704,
            "default_frames": 121,
            "max_side": 1280,
            "max_frames": 121,
            "default_fps": 24,
            "default_steps": 50,
            "max_sequence_length": 512,
        },
    },
)

I2V_FAMILY = dataclasses.replace(
    FAMILY,
    name="wan-i2v",
    pipelines=("WanImageToVideoPipeline",),
    adapter="vllm_omni_like.models.wan.i2v",
    own_loop=(Mode.IMAGE2VIDEO,),  # (each row's first-frame condition beside its noise)
    needs_image=True,
    # at 720p as published: Wan2.1-I2V-14B-720P 50 steps at CFG 5, Wan2.2-I2V-A14B 40 steps at
    # CFG 3.5 for both experts
    presets={
        "wan2.1-i2v-14b": {**WAN_720P, "default_steps": 50},
        "wan2.2-i2v-a14b": {**WAN_720P, "default_steps": 40, "default_guidance": 3.5},
    },
)
