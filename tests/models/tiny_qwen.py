"""A tiny Qwen-Image pipeline for the tests (random weights, built once per test process): its
own classes (QwenImageTransformer2DModel, AutoencoderKLQwenImage, a Qwen2.5-VL text encoder with
a one-block vision tower) at a few layers, the package's chat-shaped tokenizer
(`build_chat_tokenizer`: the template prefix the pipeline cuts is its 34 tokens)."""

from __future__ import annotations

import functools
import os
import tempfile


@functools.cache
def tiny_qwen_image_path() -> str:
    import torch
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from vllm_omni_like.models.chat_tokenizer import build_chat_tokenizer

    torch.manual_seed(0)
    tokenizer = build_chat_tokenizer()
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=32,
        fullatt_block_indexes=[0],
    )
    encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(text_config=text, vision_config=vision)
    )
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=64,  # 16 latent channels, 2x2 packed
        out_channels=16,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        axes_dims_rope=(4, 6, 6),
    )
    vae = AutoencoderKLQwenImage(
        base_dim=16,
        z_dim=16,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True],
    )
    scheduler = FlowMatchEulerDiscreteScheduler(  # Qwen-Image's own settings
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=8192,
        max_shift=0.9,
        shift=1.0,
        shift_terminal=0.02,
        time_shift_type="exponential",
        use_dynamic_shifting=True,
    )
    pipe = QwenImagePipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    path = os.path.join(tempfile.mkdtemp(prefix="tiny-qwen-image-"), "tiny-qwen-image")
    pipe.save_pretrained(path)
    return path
