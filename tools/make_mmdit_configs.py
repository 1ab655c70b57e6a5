"""Write the MMDiT architecture configs shipped in vllm_omni_like/assets/archs/ (no weights).

    python tools/make_mmdit_configs.py

FLUX.1-dev and FLUX.1-schnell (a 12B rectified-flow transformer, 19 double and 38 single
blocks; CLIP ViT-L/14 and T5-v1.1-XXL text encoders; a 16-channel KL VAE; dev with its
guidance embedding and a shift by the image's length, schnell with neither), SD3.5-large (8.1B
MMDiT, 38 blocks) and SD3.5-medium (2.5B MMDiT-X, 24 blocks, dual attention in the first 13):
two CLIPs with projections and T5-XXL, FlowMatch Euler with shift 3. Their text encoders are
real modules (random weights with `--load-format dummy`); the tokenizers are the package's
word-level one at each encoder's length (CLIP 77, T5 512 or 256), so nothing is downloaded.
Qwen-Image (and Qwen-Image-Edit): the 20.4B MMDiT with Qwen2.5-VL-7B as its text encoder;
Z-Image-Turbo: the 6B
single-stream DiT with Qwen3-4B. Published sizes are
checked by tests/models/test_mmdit.py.
"""

from __future__ import annotations

import os

import torch
from make_arch_configs import CLIP_BIG_G, CLIP_L, _clip, _index, _kl_vae, write_all

# T5-v1.1-XXL's encoder (FLUX.1's and SD3's third text encoder): 4.76B parameters
T5_XXL = dict(
    vocab_size=32128,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    layer_norm_epsilon=1e-6,
    feed_forward_proj="gated-gelu",
    tie_word_embeddings=False,
)


def _t5(out: str, folder: str, tokenizer) -> None:
    from transformers import T5Config

    T5Config(
        **T5_XXL,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id,
        architectures=["T5EncoderModel"],
    ).save_pretrained(os.path.join(out, folder))


def _vae16(out: str, scaling: float, shift: float) -> None:
    """The 16-channel KL VAE of FLUX.1 and SD3 (no quant convs; its scale and shift)."""
    _kl_vae(
        out,
        latent_channels=16,
        sample_size=1024,
        scaling_factor=scaling,
        shift_factor=shift,
        use_quant_conv=False,
        use_post_quant_conv=False,
        force_upcast=True,
    )


def _tokenizers(out: str, folders: dict[str, int]) -> None:
    from vllm_omni_like.models.tiny import build_tokenizer

    for folder, length in folders.items():
        build_tokenizer(max_length=length).save_pretrained(os.path.join(out, folder))


def flux(out: str, dev: bool) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

    from vllm_omni_like.models.tiny import build_tokenizer

    with torch.device("meta"):
        FluxTransformer2DModel(
            patch_size=1,
            in_channels=64,
            num_layers=19,
            num_single_layers=38,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=4096,
            pooled_projection_dim=768,
            guidance_embeds=dev,
            axes_dims_rope=(16, 56, 56),
        ).save_config(os.path.join(out, "transformer"))
        _vae16(out, scaling=0.3611, shift=0.1159)
    tokenizer = build_tokenizer(max_length=77)
    _clip(out, "text_encoder", tokenizer, "CLIPTextModel", **CLIP_L)
    _t5(out, "text_encoder_2", tokenizer)
    _tokenizers(out, {"tokenizer": 77, "tokenizer_2": 512 if dev else 256})
    shift = {"shift": 3.0, "use_dynamic_shifting": True} if dev else {"shift": 1.0}
    FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=4096,
        max_shift=1.15,
        num_train_timesteps=1000,
        **shift,
    ).save_config(os.path.join(out, "scheduler"))
    _index(
        out,
        "FluxPipeline",
        transformer=["diffusers", "FluxTransformer2DModel"],
        vae=["diffusers", "AutoencoderKL"],
        text_encoder=["transformers", "CLIPTextModel"],
        text_encoder_2=["transformers", "T5EncoderModel"],
        tokenizer=["transformers", "TokenizersBackend"],
        tokenizer_2=["transformers", "TokenizersBackend"],
        scheduler=["diffusers", "FlowMatchEulerDiscreteScheduler"],
        image_encoder=[None, None],
        feature_extractor=[None, None],
    )


def sd35(out: str, large: bool) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

    from vllm_omni_like.models.tiny import build_tokenizer

    size = (
        dict(num_layers=38, num_attention_heads=38, caption_projection_dim=2432)
        if large
        else dict(
            num_layers=24,
            num_attention_heads=24,
            caption_projection_dim=1536,
            dual_attention_layers=tuple(range(13)),
        )
    )
    with torch.device("meta"):
        SD3Transformer2DModel(
            sample_size=128,
            patch_size=2,
            in_channels=16,
            out_channels=16,
            attention_head_dim=64,
            joint_attention_dim=4096,
            pooled_projection_dim=2048,
            pos_embed_max_size=192 if large else 384,
            qk_norm="rms_norm",
            **size,
        ).save_config(os.path.join(out, "transformer"))
        _vae16(out, scaling=1.5305, shift=0.0609)
    tokenizer = build_tokenizer(max_length=77)
    _clip(out, "text_encoder", tokenizer, "CLIPTextModelWithProjection", **CLIP_L)
    _clip(out, "text_encoder_2", tokenizer, "CLIPTextModelWithProjection", **CLIP_BIG_G)
    _t5(out, "text_encoder_3", tokenizer)
    _tokenizers(out, {"tokenizer": 77, "tokenizer_2": 77, "tokenizer_3": 256})
    FlowMatchEulerDiscreteScheduler(shift=3.0, num_train_timesteps=1000).save_config(
        os.path.join(out, "scheduler")
    )
    _index(
        out,
        "StableDiffusion3Pipeline",
        transformer=["diffusers", "SD3Transformer2DModel"],
        vae=["diffusers", "AutoencoderKL"],
        text_encoder=["transformers", "CLIPTextModelWithProjection"],
        text_encoder_2=["transformers", "CLIPTextModelWithProjection"],
        text_encoder_3=["transformers", "T5EncoderModel"],
        tokenizer=["transformers", "TokenizersBackend"],
        tokenizer_2=["transformers", "TokenizersBackend"],
        tokenizer_3=["transformers", "TokenizersBackend"],
        scheduler=["diffusers", "FlowMatchEulerDiscreteScheduler"],
        image_encoder=[None, None],
        feature_extractor=[None, None],
    )


def qwen_image(out: str, edit: bool = False) -> None:
    """Qwen-Image: the 20.4B MMDiT (60 blocks), its video VAE run on one frame, Qwen2.5-VL-7B
    as text encoder (8.3B with its vision tower), the chat-shaped tokenizer (the pipeline cuts
    its template's first 34 tokens), FlowMatch Euler shifted by the image's length.
    Qwen-Image-Edit (`edit`): the same models; the text encoder's vision tokens are the
    tokenizer's, and the processor folder (Qwen2VLProcessor's files: the image processor at the
    real model's settings and the tokenizer) lets Qwen2.5-VL see the image (the pipeline cuts
    64 tokens)."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2VLImageProcessor

    from vllm_omni_like.models.chat_tokenizer import build_chat_tokenizer
    from vllm_omni_like.models.qwen_image.vl_processor import VisionTextProcessor

    with torch.device("meta"):
        QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=64,
            out_channels=16,
            num_layers=60,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=3584,
            axes_dims_rope=(16, 56, 56),
        ).save_config(os.path.join(out, "transformer"))
        AutoencoderKLQwenImage().save_config(os.path.join(out, "vae"))
    tokenizer = build_chat_tokenizer(max_length=1024)
    tokenizer.save_pretrained(os.path.join(out, "tokenizer"))
    vision_ids = {}
    if edit:
        images = Qwen2VLImageProcessor(min_pixels=56 * 56, max_pixels=28 * 28 * 16384)
        VisionTextProcessor(images, tokenizer).save_pretrained(os.path.join(out, "processor"))
        for name in ("vision_start", "vision_end"):
            vision_ids[f"{name}_token_id"] = tokenizer.convert_tokens_to_ids(f"<|{name}|>")
        vision_ids["image_token_id"] = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        vision_ids["video_token_id"] = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=128000,
            rope_theta=1000000.0,
            rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
            bos_token_id=None,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            depth=32,
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            out_hidden_size=3584,
            window_size=112,
            fullatt_block_indexes=[7, 15, 23, 31],
        ),
        tie_word_embeddings=False,
        architectures=["Qwen2_5_VLForConditionalGeneration"],
        **vision_ids,
    ).save_pretrained(os.path.join(out, "text_encoder"))
    FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256,
        base_shift=0.5,
        max_image_seq_len=8192,
        max_shift=0.9,
        shift=1.0,
        shift_terminal=0.02,
        time_shift_type="exponential",
        use_dynamic_shifting=True,
    ).save_config(os.path.join(out, "scheduler"))
    parts = {"processor": ["transformers", "Qwen2VLProcessor"]} if edit else {}
    _index(
        out,
        "QwenImageEditPipeline" if edit else "QwenImagePipeline",
        transformer=["diffusers", "QwenImageTransformer2DModel"],
        vae=["diffusers", "AutoencoderKLQwenImage"],
        text_encoder=["transformers", "Qwen2_5_VLForConditionalGeneration"],
        tokenizer=["transformers", "TokenizersBackend"],
        scheduler=["diffusers", "FlowMatchEulerDiscreteScheduler"],
        **parts,
    )


def z_image_turbo(out: str) -> None:
    """Z-Image-Turbo: the 6.15B single-stream DiT, FLUX's 16-channel VAE, Qwen3-4B as text
    encoder, the chat-shaped tokenizer with Qwen3's template, FlowMatch Euler (shift 3)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import Qwen3Config

    from vllm_omni_like.models.chat_tokenizer import build_chat_tokenizer

    with torch.device("meta"):
        ZImageTransformer2DModel().save_config(os.path.join(out, "transformer"))
        _vae16(out, scaling=0.3611, shift=0.1159)
    tokenizer = build_chat_tokenizer(max_length=512)
    tokenizer.save_pretrained(os.path.join(out, "tokenizer"))
    Qwen3Config(
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["Qwen3Model"],
    ).save_pretrained(os.path.join(out, "text_encoder"))
    FlowMatchEulerDiscreteScheduler(shift=3.0, num_train_timesteps=1000).save_config(
        os.path.join(out, "scheduler")
    )
    _index(
        out,
        "ZImagePipeline",
        transformer=["diffusers", "ZImageTransformer2DModel"],
        vae=["diffusers", "AutoencoderKL"],
        text_encoder=["transformers", "Qwen3Model"],
        tokenizer=["transformers", "TokenizersBackend"],
        scheduler=["diffusers", "FlowMatchEulerDiscreteScheduler"],
    )


ARCHS = {
    "flux.1-dev": lambda out: flux(out, dev=True),
    "flux.1-schnell": lambda out: flux(out, dev=False),
    "sd3.5-medium": lambda out: sd35(out, large=False),
    "sd3.5-large": lambda out: sd35(out, large=True),
    "qwen-image": qwen_image,
    "qwen-image-edit": lambda out: qwen_image(out, edit=True),
    "z-image-turbo": z_image_turbo,
}


if __name__ == "__main__":
    write_all(ARCHS)
