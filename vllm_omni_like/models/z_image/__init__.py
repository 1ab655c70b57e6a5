"""The Z-Image family (Z-Image-Turbo and its architecture `z-image-turbo`): torch-free
description; the adapter is models/z_image/adapter.py.

A 6B single-stream DiT (S3-DiT) over 2x2 patches of a 16-channel KL VAE's latents, its text
from Qwen3's second-to-last hidden states under Qwen3's chat template, each prompt at its own
token count (the transformer takes a list; sequence.py pads it on to a text bucket, masked).
Turbo runs a few steps without guidance; with guidance (above 0), the negative branch runs too
and the velocity is `cond + scale x (cond - uncond)`. Its img2img and inpainting edits
(ZImageImg2ImgPipeline, ZImageInpaintPipeline) run on our own loop too.
"""

from vllm_omni_like.models.family import Family
from vllm_omni_like.wire import Mode

FAMILY = Family(
    name="z-image",
    pipelines=("ZImagePipeline", "ZImageImg2ImgPipeline", "ZImageInpaintPipeline"),
    output="image",
    size_base=16,  # the VAE's factor x the 2x2 patches
    default_guidance=0.0,  # Turbo's: no guidance
    adapter="vllm_omni_like.models.z_image.adapter",
    fp8=True,
    fp8_attention=True,
    step_cache=True,
    own_loop=(Mode.TEXT2IMG, Mode.EDIT, Mode.INPAINT),
    inpaints=True,
    schedulers=("flow-euler",),
    presets={"z-image-turbo": {"default_steps": 9}},  # its published use
)
