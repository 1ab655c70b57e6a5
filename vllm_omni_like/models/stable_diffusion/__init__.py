"""The Stable Diffusion UNet family: SD1.5 (its architecture, the embedded tiny-image model) and
SDXL (its architecture `sdxl`), torch-free descriptions; the adapters are
models/stable_diffusion/adapter.py and xl.py."""

from vllm_omni_like.models.family import Config, Family
from vllm_omni_like.wire import Mode


def unet_takes_mask(unet: Config, vae: Config) -> bool:
    """An inpainting UNet (SD1.5's and SDXL's inpainting checkpoints: 9 channels over a VAE of
    4): the latents, the mask and the masked image's latents, 2 x the VAE's channels + 1."""
    return unet.get("in_channels") == 2 * int(vae.get("latent_channels", 4)) + 1


FAMILY = Family(
    name="stable-diffusion",
    pipelines=(
        "StableDiffusionPipeline",
        "StableDiffusionImg2ImgPipeline",
        "StableDiffusionInpaintPipeline",
    ),
    output="image",
    size_base=8,  # StableDiffusionPipeline.check_inputs
    default_guidance=7.5,
    adapter="vllm_omni_like.models.stable_diffusion.adapter",
    own_loop=(Mode.TEXT2IMG, Mode.EDIT, Mode.INPAINT),
    inpaints=True,
    takes_mask=unet_takes_mask,
    schedulers=(
        "ddim",
        "pndm",
        "euler",
        "euler-a",
        "dpm++2m",
        "dpm++2m-karras",
        "unipc",
        "dpm++2m-sde",
        "dpm++3m",
        "pndm-prk",
        "unipc-3",
    ),
    presets={"sd15": {"default_steps": 30}},
)

XL_FAMILY = Family(
    name="stable-diffusion-xl",
    pipelines=(
        "StableDiffusionXLPipeline",
        "StableDiffusionXLImg2ImgPipeline",
        "StableDiffusionXLInpaintPipeline",
    ),
    output="image",
    size_base=8,  # StableDiffusionXLPipeline.check_inputs
    default_guidance=5.0,  # StableDiffusionXLPipeline's
    adapter="vllm_omni_like.models.stable_diffusion.xl",
    own_loop=FAMILY.own_loop,
    inpaints=True,
    takes_mask=unet_takes_mask,
    schedulers=FAMILY.schedulers,
    presets={"sdxl": {"default_steps": 30}},
)
