"""A tiny SDXL pipeline for the tests (random weights, built once per test process): the UNet
family's second member with SDXL's conditioning - two CLIP text encoders (the second with a
projection: the pooled embedding), `text_time` added embeddings, a 64x64 KL VAE."""

from __future__ import annotations

import functools

from tests.models.model_dir import model_dir


@functools.cache
def tiny_sdxl_path() -> str:
    import torch
    from diffusers import (
        DDIMScheduler,
        EulerDiscreteScheduler,
        StableDiffusionXLPipeline,
        UNet2DConditionModel,
    )
    from transformers import (
        CLIPTextConfig,
        CLIPTextModel,
        CLIPTextModelWithProjection,
    )

    from vllm_omni_like.models.tiny import SD_SCHEDULER, build_tokenizer, tiny_image_vae

    torch.manual_seed(0)
    tokenizer = build_tokenizer()

    def text_config(**kw) -> CLIPTextConfig:
        return CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=tokenizer.model_max_length,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **kw,
        )

    unet = UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(32, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(2, 4),
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        transformer_layers_per_block=(1, 2),
        projection_class_embeddings_input_dim=6 * 8 + 32,  # time ids + the pooled embedding
        cross_attention_dim=64,  # the two encoders' states side by side
        norm_num_groups=16,
    )
    pipe = StableDiffusionXLPipeline(
        vae=tiny_image_vae(),
        text_encoder=CLIPTextModel(text_config()),
        text_encoder_2=CLIPTextModelWithProjection(text_config(projection_dim=32)),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer,
        unet=unet,
        # SDXL's own kind of scheduler, over SD's noise schedule
        scheduler=EulerDiscreteScheduler.from_config(DDIMScheduler(**SD_SCHEDULER).config),
    )
    path = model_dir("tiny-sdxl")
    pipe.save_pretrained(path)
    return path
