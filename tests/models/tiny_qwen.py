"""Tiny Qwen-Image and Qwen-Image-Edit pipelines for the tests (random weights, built once per
test process): their own classes (QwenImageTransformer2DModel, AutoencoderKLQwenImage, a
Qwen2.5-VL text encoder with a one-block vision tower) at a few layers, the package's
chat-shaped tokenizer (`build_chat_tokenizer`: the template prefixes the pipelines cut are its
34 and 64 tokens); the edit model's processor folder as the real one's (Qwen2VLProcessor's
files: the image processor's config and the tokenizer), its vision limited to a few patches."""

from __future__ import annotations

import functools
import json
import os

from tests.models.model_dir import model_dir


@functools.cache
def tiny_qwen_image_path() -> str:
    from diffusers import QwenImagePipeline

    path = model_dir("tiny-qwen-image")
    QwenImagePipeline(**_components()).save_pretrained(path)
    return path


@functools.cache
def tiny_qwen_image_edit_path() -> str:
    from diffusers import QwenImageEditPipeline
    from transformers import Qwen2VLImageProcessor

    from vllm_omni_like.models.qwen_image.vl_processor import VisionTextProcessor

    parts = _components(vision=True)
    path = model_dir("tiny-qwen-image-edit")
    tokenizer = parts["tokenizer"]
    QwenImageEditPipeline(**parts, processor=None).save_pretrained(path)
    images = Qwen2VLImageProcessor(min_pixels=28 * 28, max_pixels=56 * 56)  # 4 patches at most
    VisionTextProcessor(images, tokenizer).save_pretrained(os.path.join(path, "processor"))
    index_file = os.path.join(path, "model_index.json")
    with open(index_file) as f:
        index = json.load(f)
    index["processor"] = ["transformers", "Qwen2VLProcessor"]  # (as the real model's)
    with open(index_file, "w") as f:
        json.dump(index, f)
    return path


def _components(vision: bool = False) -> dict:
    import torch
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
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
    tower = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=32,
        fullatt_block_indexes=[0],
    )
    ids = {  # where the vision tokens are in this tokenizer
        f"{name}_token_id": tokenizer.convert_tokens_to_ids(f"<|{name}|>")
        for name in ("vision_start", "vision_end")
    }
    ids["image_token_id"] = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    ids["video_token_id"] = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(text_config=text, vision_config=tower, **(ids if vision else {}))
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
    # (the edit model's: 16x down, so the megapixel its pipeline fits the image to for the VAE
    # is 32x32 tokens, not 128x128)
    down = [False, True, True, True] if vision else [False, True]
    vae = AutoencoderKLQwenImage(
        base_dim=8 if vision else 16,
        z_dim=16,
        dim_mult=[1] + [2] * len(down),
        num_res_blocks=1,
        temperal_downsample=down,
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
    return dict(
        scheduler=scheduler,
        vae=vae,
        text_encoder=encoder,
        tokenizer=tokenizer,
        transformer=transformer,
    )
