"""Tiny Wan2.2- and image-to-video-shaped pipelines for the tests (random weights, built once per
test process). WanPipeline as Wan2.2 ships it: `experts` - two transformers switched at
`boundary_ratio` of the train timesteps (T2V-A14B's 0.875: the high-noise expert first); `ti2v`
- one transformer given a timestep per latent token (`expand_timesteps`, TI2V-5B's) over
Wan2.2's VAE (a residual VAE on 2x2-patched pixels, 12 channels in). WanImageToVideoPipeline:
`wan21_i2v` (a CLIP image encoder) and `wan22_i2v_experts` (two experts, none). And the
two-expert model's stage and video requests, as its tests run them (test_wan22.py,
stages/diffusion/test_offload_stage.py)."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import numpy as np

from tests.models.model_dir import model_dir
from vllm_omni_like.config import StageConfig
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.wire import StageRequest

if TYPE_CHECKING:
    from vllm_omni_like.stages.diffusion.stage import DiffusionStage

OPTIONS = {"default_size": 64}  # (not a tiny model's name: its default would be 512)


def _save(pipe, name: str) -> str:
    path = model_dir(name)
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


def _i2v_transformer(base, **extra):
    """The image-to-video transformer over the tiny VAE: the noise's 8 channels, the first
    frame's latents' 8 and the frame mask's 2 (the VAE's temporal factor) in, 8 out."""
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel.from_config(
        {**base.transformer.config, "in_channels": 18, "out_channels": 8, **extra}
    )


@functools.cache
def tiny_wan21_i2v_path() -> str:
    """Wan2.1-I2V's shape: one transformer that also attends to the image's CLIP features
    (a tiny CLIP vision tower: its second-to-last hidden states, 32 wide)."""
    import torch
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    from vllm_omni_like.models.tiny import video_pipeline

    torch.manual_seed(0)
    base = video_pipeline()
    torch.manual_seed(2)
    vision = CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        )
    )
    inner = base.transformer.config.num_attention_heads * base.transformer.config.attention_head_dim
    pipe = WanImageToVideoPipeline(
        tokenizer=base.tokenizer,
        text_encoder=base.text_encoder,
        vae=base.vae,
        scheduler=base.scheduler,
        image_processor=CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=32),
        image_encoder=vision,
        transformer=_i2v_transformer(base, image_dim=32, added_kv_proj_dim=inner),
    )
    return _save(pipe, "tiny-wan21-i2v")


@functools.cache
def tiny_wan22_i2v_experts_path() -> str:
    """Wan2.2-I2V-A14B's shape: two image-to-video experts (no image encoder) switched at
    `boundary_ratio` 0.9 of the train timesteps."""
    import torch
    from diffusers import WanImageToVideoPipeline

    from vllm_omni_like.models.tiny import video_pipeline

    torch.manual_seed(0)
    base = video_pipeline()
    torch.manual_seed(3)
    high, low = _i2v_transformer(base), _i2v_transformer(base)
    pipe = WanImageToVideoPipeline(
        tokenizer=base.tokenizer,
        text_encoder=base.text_encoder,
        vae=base.vae,
        scheduler=base.scheduler,
        transformer=high,
        transformer_2=low,
        boundary_ratio=0.9,
    )
    return _save(pipe, "tiny-wan22-i2v-experts")


def experts_config(**more: Any) -> StageConfig:
    """The two-expert model's diffusion stage; `more`: its other fields."""
    return StageConfig(
        name="diffusion",
        kind="diffusion",
        model=tiny_wan22_experts_path(),
        **{"options": OPTIONS, **more},
    )


def experts_stage(**more: Any) -> DiffusionStage:
    """`experts_config(**more)`'s stage, loaded on the CPU."""
    from vllm_omni_like.stages.diffusion.stage import DiffusionStage

    stage = DiffusionStage(experts_config(**more))
    stage.load("cpu")
    return stage


def video_request(rid: str, seed: int, steps: int, **more: Any) -> StageRequest:
    """A text-to-video request of 5 frames; `more`: its other parameters."""
    params = GenerationParams(seed=seed, num_inference_steps=steps, num_frames=5, **more)
    return StageRequest(rid, "a red circle", params, mode="text2video")


def video_frames(outputs: dict, rid: str) -> np.ndarray:
    """The frames of request `rid`'s output among `outputs` (which must not be an error)."""
    out = outputs[rid]
    assert out.error is None, out.error
    return out.video.frames.astype(np.int16)
