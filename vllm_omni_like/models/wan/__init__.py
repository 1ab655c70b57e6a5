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


FAMILY = Family(
    name="wan",
    pipelines=("WanPipeline",),
    output="video",
    size_base=16,  # WanPipeline.check_inputs
    default_guidance=5.0,
    adapter="vllm_omni_like.models.wan.adapter",
    vae_factors=wan_vae_factors,
    own_loop=(Mode.TEXT2VIDEO,),
    schedulers=("unipc", "flow-euler"),
)

# its first frame given: WanImageToVideoPipeline over the same models (the pipeline's call)
TI2V_FAMILY = dataclasses.replace(
    FAMILY,
    name="wan-ti2v",
    adapter="vllm_omni_like.models.wan.ti2v",
    video_from_image=True,
    config_flag="expand_timesteps",
)

I2V_FAMILY = dataclasses.replace(
    FAMILY,
    name="wan-i2v",
    pipelines=("WanImageToVideoPipeline",),
    adapter="vllm_omni_like.models.wan.i2v",
    own_loop=(),  # (the pipeline's call: the image's latents and mask join each step's input)
    schedulers=(),  # (its own scheduler)
    needs_image=True,
)
