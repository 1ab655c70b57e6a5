"""A tiny Z-Image pipeline for the tests (random weights, built once per test process): its own
classes (ZImageTransformer2DModel, a Qwen3 text encoder, a KL VAE with a shift factor) at a few
layers, the package's chat-shaped tokenizer with Qwen3's chat template."""

from __future__ import annotations

import functools

from tests.models.model_dir import model_dir


@functools.cache
def tiny_z_image_path() -> str:
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    from tests.models.tiny_mmdit import _vae
    from vllm_omni_like.models.chat_tokenizer import build_chat_tokenizer

    torch.manual_seed(0)
    tokenizer = build_chat_tokenizer()
    encoder = Qwen3Model(
        Qwen3Config(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=1024,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=None,
        )
    )
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=4,
        dim=32,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=32,  # the text encoder's width
        axes_dims=[8, 4, 4],  # the head's 16 dims
        axes_lens=[1024, 64, 64],
    )
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),  # Z-Image-Turbo's
        vae=_vae(4),
        text_encoder=encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
    path = model_dir("tiny-z-image")
    pipe.save_pretrained(path)
    return path
