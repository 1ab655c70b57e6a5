"""An image-to-image row's start, as the img2img pipelines make it: the source image's latents
(the VAE's sample with the row's own generator, shifted and scaled by the VAE's config) and the
steps a strength runs (`get_timesteps`). The adapter picks the rule of its family's pipeline
(models/adapter.py `encode_image`, `edit_steps`); the noising at the first step is the
scheduler's (models/row_schedulers.py `add_noise`)."""

from __future__ import annotations

from typing import Any

import torch


def encode(
    vae: Any, pixels: torch.Tensor, generator: torch.Generator | None, dtype: torch.dtype
) -> torch.Tensor:
    """`pixels` (1, 3, H, W in [-1, 1], the VAE's dtype) as latents: a sample of the VAE's
    distribution drawn with `generator` (the pipelines' `retrieve_latents`) in `dtype`, then
    `(x - shift) * scale` (SD3, FLUX.1), `(x - mean) * scale / std` (a VAE with per-channel
    statistics) or `x * scale` (SD)."""
    from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img import (
        retrieve_latents,
    )

    latents: torch.Tensor = retrieve_latents(vae.encode(pixels), generator=generator)
    latents = latents.to(dtype)
    config = vae.config
    scale = float(config.scaling_factor)
    if getattr(config, "shift_factor", None) is not None:
        return (latents - float(config.shift_factor)) * scale
    if getattr(config, "latents_mean", None) is not None and config.latents_std is not None:
        shape = (1, len(config.latents_mean), 1, 1)
        mean = torch.tensor(config.latents_mean).view(shape).to(latents.device, latents.dtype)
        std = torch.tensor(config.latents_std).view(shape).to(latents.device, latents.dtype)
        return (latents - mean) * scale / std
    return scale * latents


def whole_steps(steps: int, strength: float) -> tuple[int, int]:
    """(steps, the first one run) as StableDiffusion(XL)Img2ImgPipeline takes them: the last
    int(steps x strength) of `steps`; `steps` grows until one runs (the API asks for enough)."""
    while int(steps * strength) < 1:
        steps += 1
    run = min(int(steps * strength), steps)
    return steps, max(steps - run, 0)


def fractional_steps(steps: int, strength: float) -> tuple[int, int]:
    """(steps, the first one run) as the flow-matching img2img pipelines (SD3, FLUX.1) take
    them: from int(steps - steps x strength) on; `steps` grows until one runs."""
    while int(max(steps - min(steps * strength, steps), 0)) >= steps:
        steps += 1
    return steps, int(max(steps - min(steps * strength, steps), 0))
