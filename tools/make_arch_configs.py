"""Write the architecture configs shipped in vllm_omni_like/assets/archs/ (no weights).

    python tools/make_arch_configs.py

SD1.5 (UNet 860M, KL VAE, CLIP ViT-L/14 text encoder, DDIM), SDXL 1.0 base (UNet 2.57B, two
CLIP text encoders, Euler) and Wan2.1-T2V-1.3B (1.42B transformer, Wan VAE, UniPC flow
scheduler). They load with `--load-format dummy`: the same
architecture, random weights, which cost the same compute as trained ones. Models are built on
the meta device here, so writing the configs takes no memory. The tokenizer is the package's
word-level one (ids < 49408, 77 tokens); Wan's UMT5 encoder is left out: the stage feeds it
seeded random prompt embeddings instead (vllm_omni_like/stages/diffusion/prompt_embeds.py).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable

import torch

OUT = os.path.join(os.path.dirname(__file__), "..", "vllm_omni_like", "assets", "archs")


# CLIP ViT-L/14 (SD1.5's encoder, SDXL's first) and OpenCLIP ViT-bigG/14 (SDXL's second)
CLIP_L = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    projection_dim=768,
    hidden_act="quick_gelu",
)
CLIP_BIG_G = dict(
    hidden_size=1280,
    intermediate_size=5120,
    num_hidden_layers=32,
    num_attention_heads=20,
    projection_dim=1280,
    hidden_act="gelu",
)


def _kl_vae(out: str, latent_channels: int = 4, **config: object) -> None:
    """The KL VAE of SD1.5 and SDXL (4 latent channels), FLUX.1's and SD3's (16): its sample
    size, scaling and the rest from `config`."""
    from diffusers import AutoencoderKL

    AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=latent_channels,
        layers_per_block=2,
        block_out_channels=(128, 256, 512, 512),
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        **config,
    ).save_config(os.path.join(out, "vae"))


def _clip(out: str, folder: str, tokenizer, kind: str, **size: object) -> None:
    from transformers import CLIPTextConfig

    CLIPTextConfig(
        vocab_size=49408,
        max_position_embeddings=77,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=[kind],
        **size,
    ).save_pretrained(os.path.join(out, folder))


def sd15(out: str) -> None:
    from diffusers import DDIMScheduler, UNet2DConditionModel

    from vllm_omni_like.models.tiny import SD_SCHEDULER, build_tokenizer

    with torch.device("meta"):
        UNet2DConditionModel(
            sample_size=64,
            in_channels=4,
            out_channels=4,
            layers_per_block=2,
            block_out_channels=(320, 640, 1280, 1280),
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
            cross_attention_dim=768,
            attention_head_dim=8,
        ).save_config(os.path.join(out, "unet"))
        _kl_vae(out, sample_size=512)
    tokenizer = build_tokenizer(max_length=77)
    _clip(out, "text_encoder", tokenizer, "CLIPTextModel", **CLIP_L)
    tokenizer.save_pretrained(os.path.join(out, "tokenizer"))
    DDIMScheduler(**SD_SCHEDULER).save_config(os.path.join(out, "scheduler"))
    _index(
        out,
        "StableDiffusionPipeline",
        unet=["diffusers", "UNet2DConditionModel"],
        vae=["diffusers", "AutoencoderKL"],
        text_encoder=["transformers", "CLIPTextModel"],
        tokenizer=["transformers", "TokenizersBackend"],
        scheduler=["diffusers", "DDIMScheduler"],
        safety_checker=[None, None],
        feature_extractor=[None, None],
        image_encoder=[None, None],
        requires_safety_checker=False,
    )


def sdxl(out: str) -> None:
    """SDXL 1.0 base: UNet 2.57B (text_time conditioning), a VAE that decodes in float32
    (force_upcast), CLIP ViT-L/14 and OpenCLIP ViT-bigG/14 text encoders, Euler."""
    from diffusers import EulerDiscreteScheduler, UNet2DConditionModel

    from vllm_omni_like.models.tiny import SD_SCHEDULER, build_tokenizer

    with torch.device("meta"):
        UNet2DConditionModel(
            sample_size=128,
            in_channels=4,
            out_channels=4,
            layers_per_block=2,
            block_out_channels=(320, 640, 1280),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            attention_head_dim=(5, 10, 20),
            use_linear_projection=True,
            transformer_layers_per_block=(1, 2, 10),
            cross_attention_dim=2048,
            addition_embed_type="text_time",
            addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=2816,
        ).save_config(os.path.join(out, "unet"))
        _kl_vae(out, sample_size=1024, scaling_factor=0.13025, force_upcast=True)
    tokenizer = build_tokenizer(max_length=77)
    _clip(out, "text_encoder", tokenizer, "CLIPTextModel", **CLIP_L)
    _clip(out, "text_encoder_2", tokenizer, "CLIPTextModelWithProjection", **CLIP_BIG_G)
    for folder in ("tokenizer", "tokenizer_2"):
        tokenizer.save_pretrained(os.path.join(out, folder))
    base = {k: v for k, v in SD_SCHEDULER.items() if k not in ("clip_sample", "set_alpha_to_one")}
    EulerDiscreteScheduler(**base).save_config(os.path.join(out, "scheduler"))
    _index(
        out,
        "StableDiffusionXLPipeline",
        unet=["diffusers", "UNet2DConditionModel"],
        vae=["diffusers", "AutoencoderKL"],
        text_encoder=["transformers", "CLIPTextModel"],
        text_encoder_2=["transformers", "CLIPTextModelWithProjection"],
        tokenizer=["transformers", "TokenizersBackend"],
        tokenizer_2=["transformers", "TokenizersBackend"],
        scheduler=["diffusers", "EulerDiscreteScheduler"],
        feature_extractor=[None, None],
        image_encoder=[None, None],
        force_zeros_for_empty_prompt=True,
    )


# Wan's transformers (patch 1x2x2, UMT5-XXL's 4096-wide text, 128-wide heads) at their
# published sizes: Wan2.1-1.3B 1.42B, Wan2.1-14B (also each expert of Wan2.2-A14B) 14.29B,
# Wan2.2-TI2V-5B 5.00B; and the flow shift each ships with (480p: 3; 720p: 5; A14B: 12)
WAN = {
    "wan2.1-t2v-1.3b": dict(num_attention_heads=12, ffn_dim=8960, num_layers=30, in_channels=16),
    "wan2.1-t2v-14b": dict(num_attention_heads=40, ffn_dim=13824, num_layers=40, in_channels=16),
    "wan2.2-t2v-a14b": dict(num_attention_heads=40, ffn_dim=13824, num_layers=40, in_channels=16),
    "wan2.2-ti2v-5b": dict(num_attention_heads=24, ffn_dim=14336, num_layers=30, in_channels=48),
    # image to video: the noise's 16 channels, the first frame's latents' 16, the frame mask's 4
    "wan2.1-i2v-14b": dict(
        num_attention_heads=40,
        ffn_dim=13824,
        num_layers=40,
        in_channels=36,
        image_dim=1280,  # CLIP ViT-H/14's width (its second-to-last hidden states)
        added_kv_proj_dim=5120,
    ),
    "wan2.2-i2v-a14b": dict(num_attention_heads=40, ffn_dim=13824, num_layers=40, in_channels=36),
}
WAN_SHIFT = {"wan2.1-t2v-1.3b": 3.0, "wan2.2-t2v-a14b": 12.0}  # (others: 5)
WAN_EXPERTS = {"wan2.2-t2v-a14b": 0.875, "wan2.2-i2v-a14b": 0.9}  # their boundary ratios


def wan(out: str, model: str) -> None:
    """Wan2.1-T2V-1.3B and -14B, Wan2.2-T2V-A14B (two 14B experts, the high-noise one down to
    timestep 875), Wan2.2-TI2V-5B (a timestep per latent token, Wan2.2's VAE: residual, on
    2x2 pixel patches, 48 channels, 16x down), Wan2.1-I2V-14B (WanImageToVideoPipeline, CLIP
    ViT-H/14's image features in each block's cross-attention) and Wan2.2-I2V-A14B (two
    experts, to timestep 900, no image encoder), all with UniPC over the flow. UMT5-XXL is left
    out (random prompt embeddings). Wan2.2's VAE latent mean and spread are not the trained
    ones (0 and 1: the weights are random anyway)."""
    from diffusers import UniPCMultistepScheduler, WanTransformer3DModel

    size = WAN[model]
    experts = model in WAN_EXPERTS
    with torch.device("meta"):
        for name in ("transformer", "transformer_2") if experts else ("transformer",):
            WanTransformer3DModel(
                patch_size=(1, 2, 2),
                attention_head_dim=128,
                out_channels=48 if size["in_channels"] == 48 else 16,
                text_dim=4096,
                freq_dim=256,
                cross_attn_norm=True,
                qk_norm="rms_norm_across_heads",
                eps=1e-6,
                **size,
            ).save_config(os.path.join(out, name))
        _wan_vae(out, size["in_channels"] == 48)
    UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        flow_shift=WAN_SHIFT.get(model, 5.0),
        num_train_timesteps=1000,
    ).save_config(os.path.join(out, "scheduler"))
    config: dict[str, object] = {"boundary_ratio": WAN_EXPERTS[model]} if experts else {}
    if size["in_channels"] == 48:
        config["expand_timesteps"] = True
    parts: dict[str, object] = {}
    if "image_dim" in size:
        parts = _clip_vision(out)
    elif size["in_channels"] == 36:
        parts = {"image_encoder": [None, None], "image_processor": [None, None]}
    _index(
        out,
        "WanImageToVideoPipeline" if size["in_channels"] == 36 else "WanPipeline",
        transformer=["diffusers", "WanTransformer3DModel"],
        vae=["diffusers", "AutoencoderKLWan"],
        scheduler=["diffusers", "UniPCMultistepScheduler"],
        text_encoder=[None, None],
        tokenizer=[None, None],
        transformer_2=["diffusers", "WanTransformer3DModel"] if experts else [None, None],
        **parts,
        **config,
    )


def _wan_vae(out: str, wan22: bool) -> None:
    """Wan2.1's VAE (8x down, 16 channels), or Wan2.2's (16x, 48, on 2x2 pixel patches)."""
    from diffusers import AutoencoderKLWan

    if wan22:
        AutoencoderKLWan(
            base_dim=160,
            decoder_base_dim=256,
            z_dim=48,
            is_residual=True,
            in_channels=12,
            out_channels=12,
            patch_size=2,
            scale_factor_spatial=16,
            latents_mean=[0.0] * 48,
            latents_std=[1.0] * 48,
        ).save_config(os.path.join(out, "vae"))
    else:
        AutoencoderKLWan(base_dim=96, z_dim=16).save_config(os.path.join(out, "vae"))


def _clip_vision(out: str) -> dict[str, object]:
    """Wan2.1-I2V's image encoder: CLIP ViT-H/14's vision tower (632M) at 224x224, and its
    image processor; their model_index.json entries."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig

    CLIPVisionConfig(
        hidden_size=1280,
        intermediate_size=5120,
        num_hidden_layers=32,
        num_attention_heads=16,
        image_size=224,
        patch_size=14,
        projection_dim=1024,
        hidden_act="gelu",
    ).save_pretrained(os.path.join(out, "image_encoder"))
    CLIPImageProcessor(crop_size=224, size={"shortest_edge": 224}).save_pretrained(
        os.path.join(out, "image_processor")
    )
    return {
        "image_encoder": ["transformers", "CLIPVisionModel"],
        "image_processor": ["transformers", "CLIPImageProcessor"],
    }


def _index(out: str, cls: str, **entries: object) -> None:
    import diffusers

    index = {"_class_name": cls, "_diffusers_version": diffusers.__version__, **entries}
    with open(os.path.join(out, "model_index.json"), "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.write("\n")


def write_all(builds: dict[str, Callable[[str], None]]) -> None:
    """Each architecture's folder under OUT, written afresh by its build."""
    for name, build in builds.items():
        out = os.path.join(OUT, name)
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        build(out)
        print("wrote", os.path.normpath(out), file=sys.stderr)


def main() -> None:
    builds: dict[str, Callable[[str], None]] = {"sd15": sd15, "sdxl": sdxl}
    for model in WAN:
        builds[model] = lambda out, model=model: wan(out, model)
    write_all(builds)


if __name__ == "__main__":
    main()
