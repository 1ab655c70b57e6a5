"""Tiny Wan2.2-shaped pipelines for the tests (random weights, built once per test process), both
WanPipeline as Wan2.2 ships it: `experts` - two transformers switched at `boundary_ratio` of the
train timesteps (T2V-A14B's 0.875: the high-noise expert first); `ti2v` - one transformer given
a timestep per latent token (`expand_timesteps`, TI2V-5B's) over Wan2.2's VAE (a residual
VAE on 2x2-patched pixels, 12 channels in)."""

from __future__ import annotations

import functools
import os
import tempfile


def _save(pipe, name: str) -> str:
    path = os.path.join(tempfile.mkdtemp(prefix=f"{name}-"), name)
    pipe.save_pretrained(path)
    return path


@functools.cache
def tiny_wan22_experts_path() -> str:
    import torch
    from diffusers import WanPipeline, WanTransformer3DModel

    from vllm_omni_like.models.tiny import video_pipeline

    torch.manual_seed(0)
    base = video_pipeline()
    torch.manual_seed(1)
    low_noise = WanTransformer3DModel.from_config(base.transformer.config)  # its own weights
    pipe = WanPipeline(
        tokenizer=base.tokenizer,
        text_encoder=base.text_encoder,
        transformer=base.transformer,
        transformer_2=low_noise,
        vae=base.vae,
        scheduler=base.scheduler,
        boundary_ratio=0.875,
    )
    return _save(pipe, "tiny-wan22-experts")


@functools.cache
def tiny_wan22_ti2v_path() -> str:
    import torch
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

    from vllm_omni_like.models.tiny import video_pipeline

    torch.manual_seed(0)
    base = video_pipeline()
    vae = AutoencoderKLWan(  # Wan2.2's: residual, on 2x2 patches of pixels
        base_dim=16,
        z_dim=12,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=8,
        scale_factor_temporal=2,
        latents_mean=[0.1 * i for i in range(12)],
        latents_std=[1.0 + 0.1 * i for i in range(12)],
    )
    transformer = WanTransformer3DModel.from_config(
        {**base.transformer.config, "in_channels": 12, "out_channels": 12}
    )
    pipe = WanPipeline(
        tokenizer=base.tokenizer,
        text_encoder=base.text_encoder,
        transformer=transformer,
        vae=vae,
        scheduler=base.scheduler,
        expand_timesteps=True,
    )
    return _save(pipe, "tiny-wan22-ti2v")
