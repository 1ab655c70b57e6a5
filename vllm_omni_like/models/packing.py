"""What the packed-token MMDiTs share (FLUX.1, Qwen-Image): latents as 2x2 patches packed into
tokens, and a flow-match schedule given the pipeline's sigmas and shifted by the image's token
count. Our loop keeps such latents unpacked, (rows, C, 2h, 2w): every update of the loop is
elementwise, so it commutes with the packing, and a row's noise is the pipeline's draw before
it packs; a forward packs and unpacks."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def pack(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, H/2 x W/2, 4C): the pipelines' `_pack_latents`."""
    b, c, h, w = latents.shape
    tokens = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return tokens.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, H/2 x W/2, 4C) -> (B, C, H, W): `_unpack_latents` (H, W: latent rows, columns)."""
    b, _, channels = tokens.shape
    grid = tokens.view(b, h // 2, w // 2, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return grid.reshape(b, channels // 4, h, w)


def latent_side(pixels: int, vae_scale: int) -> int:
    """Latent rows (or columns) of an image side: a multiple of the 2x2 packing."""
    return 2 * (pixels // (2 * vae_scale))


def shifted_flow_schedule(
    scheduler: Any, steps: int, width: int, height: int, vae_scale: int
) -> dict[str, Any]:
    """The pipelines' `set_timesteps` arguments: sigmas from 1 down to 1/steps, and the shift
    `mu` of the image's token count (used where the scheduler shifts dynamically)."""
    if type(scheduler).__name__ != "FlowMatchEulerDiscreteScheduler":
        return {}
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    config = scheduler.config
    args: dict[str, Any] = {}
    if not config.get("use_flow_sigmas", False):
        args["sigmas"] = np.linspace(1.0, 1 / steps, steps).tolist()
    tokens = (latent_side(height, vae_scale) // 2) * (latent_side(width, vae_scale) // 2)
    args["mu"] = calculate_shift(
        tokens,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", 1.15),
    )
    return args
