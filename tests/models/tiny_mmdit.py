"""Tiny FLUX.1 and SD3 pipelines for the tests (random weights, built once per test process):
the MMDiT families' own classes (FluxTransformer2DModel, SD3Transformer2DModel, CLIP and T5
text encoders, a KL VAE with a shift factor) at a few layers, tokenizers synthesized offline
(the package's word-level one: 32 CLIP tokens, 24 T5 tokens)."""

from __future__ import annotations

import functools
from typing import Any

from tests.models.model_dir import model_dir

T5_TOKENS = 24


def _vae(channels: int = 4) -> Any:
    """A 64x64 KL VAE without quant convs, scaled and shifted as FLUX's and SD3's are."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=channels,
        block_out_channels=(32, 64, 64),
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        norm_num_groups=16,
        sample_size=64,
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def _texts(width: int, projection: bool, count: int) -> dict[str, Any]:
    """`count` CLIP encoders (with projections where asked), T5, and their tokenizers."""
    from transformers import (
        CLIPTextConfig,
        CLIPTextModel,
        CLIPTextModelWithProjection,
        T5Config,
        T5EncoderModel,
    )

    from vllm_omni_like.models.tiny import build_tokenizer

    clip_tokens, t5_tokens = build_tokenizer(), build_tokenizer(max_length=T5_TOKENS)
    clip = CLIPTextConfig(
        vocab_size=len(clip_tokens),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=clip_tokens.model_max_length,
        projection_dim=32,
        bos_token_id=clip_tokens.bos_token_id,
        eos_token_id=clip_tokens.eos_token_id,
        pad_token_id=clip_tokens.pad_token_id,
    )
    t5 = T5Config(
        vocab_size=len(t5_tokens),
        d_model=width,
        d_ff=2 * width,
        d_kv=8,
        num_heads=4,
        num_layers=2,
        relative_attention_num_buckets=8,
        feed_forward_proj="gated-gelu",
        pad_token_id=t5_tokens.pad_token_id,
        eos_token_id=t5_tokens.eos_token_id,
        decoder_start_token_id=t5_tokens.pad_token_id,
    )
    cls = CLIPTextModelWithProjection if projection else CLIPTextModel
    parts = {"text_encoder": cls(clip), "tokenizer": clip_tokens}
    if count == 2:
        parts.update(text_encoder_2=cls(clip), tokenizer_2=clip_tokens)
    last = "_3" if count == 2 else "_2"
    parts.update({f"text_encoder{last}": T5EncoderModel(t5), f"tokenizer{last}": t5_tokens})
    return parts


def _save(pipe: Any, name: str) -> str:
    path = model_dir(name)
    pipe.save_pretrained(path)
    return path


@functools.cache
def tiny_flux_path(guidance_embeds: bool = True) -> str:
    """FLUX.1-dev's shape (guidance embedding, dynamic shift), or schnell's (neither)."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,  # 4 latent channels, 2x2 packed
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        guidance_embeds=guidance_embeds,
        axes_dims_rope=(4, 6, 6),
    )
    if guidance_embeds:  # dev: shifted by the image's length
        scheduler = FlowMatchEulerDiscreteScheduler(
            shift=3.0,
            use_dynamic_shifting=True,
            base_shift=0.5,
            max_shift=1.15,
            base_image_seq_len=16,
            max_image_seq_len=256,
        )
    else:
        scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0)
    pipe = FluxPipeline(
        transformer=transformer, vae=_vae(), scheduler=scheduler, **_texts(32, False, 1)
    )
    return _save(pipe, "tiny-flux-dev" if guidance_embeds else "tiny-flux-schnell")


@functools.cache
def tiny_sd3_path(dual: bool = True) -> str:
    """SD3.5-medium's shape: MMDiT-X (a dual-attention layer), RMS-normed q/k, two CLIPs;
    `dual` False: SD3.5-large's (plain MMDiT blocks)."""
    import torch
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )

    torch.manual_seed(0)
    transformer = SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=16,  # (its inpaint pipeline wants the real 16 latent channels)
        out_channels=16,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=64,  # T5's width (the CLIPs' 32 + 32 padded to it)
        caption_projection_dim=32,
        pooled_projection_dim=64,  # both CLIPs' projections
        pos_embed_max_size=16,
        qk_norm="rms_norm",
        dual_attention_layers=(0,) if dual else (),
    )
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        vae=_vae(16),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        **_texts(64, True, 2),
    )
    return _save(pipe, "tiny-sd3" if dual else "tiny-sd3-large")
