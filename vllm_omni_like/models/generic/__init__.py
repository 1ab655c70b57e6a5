"""Any other diffusers pipeline: run through its own `__call__`, whole requests batched together,
without the families' own decode, CFG batching or streamed encode (the server says so at
start-up). What it makes and its geometry are read from its config files."""

from __future__ import annotations

from vllm_omni_like.models.family import Config, Family, vae_factors_by_blocks

# class-name parts of diffusers' video pipelines (a video VAE with a time axis says so too)
VIDEO_CLASS_HINTS = ("Video", "I2V", "T2V")


def generic_vae_factors(vae: Config) -> tuple[int, int | None]:
    if "scale_factor_spatial" in vae:  # a video VAE that says its factors
        return int(vae["scale_factor_spatial"]), int(vae["scale_factor_temporal"])
    return vae_factors_by_blocks(vae)


def generic_family(class_name: str, vae: Config) -> Family:
    video = any(h in class_name for h in VIDEO_CLASS_HINTS) or "scale_factor_temporal" in vae
    return Family(
        name="generic",
        pipelines=(class_name,),
        output="video" if video else "image",
        # diffusers' video pipelines with such a VAE ask 16 of width and height, others 8
        size_base=16 if "scale_factor_spatial" in vae else 8,
        default_guidance=5.0 if video else 7.5,
        adapter="vllm_omni_like.models.generic.adapter",
        vae_factors=generic_vae_factors,
    )
