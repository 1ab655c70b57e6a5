"""The embedded default models, built offline by the package: nothing is ever downloaded.

Each is a standard transformers / diffusers directory, so it loads through the same stage code
as a user's model. Trained weights shipped in `vllm_omni_like/assets/<name>/` win; otherwise
the architecture is built from fixed seeds into the cache directory, once.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from importlib import resources
from typing import Any

from vllm_omni_like.config import cache_dir
from vllm_omni_like.models.tiny_llm import build_llm

TINY_NAMES = ("tiny-llm", "tiny-image", "tiny-video")
BUILD_VERSION = "3"
MAX_TEXT_TOKENS = 32
# Stable Diffusion's DDIM settings (SD1.5's scheduler config): the tiny image model's
SD_SCHEDULER = {
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "clip_sample": False,
    "set_alpha_to_one": False,
    "steps_offset": 1,
}

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<sep>"]
WORDS = [
    "a",
    "an",
    "the",
    "at",
    "on",
    "in",
    "of",
    "and",
    "with",
    "to",
    "is",
    "moving",
    "towards",
    "left",
    "right",
    "top",
    "bottom",
    "center",
    "middle",
    "upper",
    "lower",
    "corner",
    "background",
    "small",
    "large",
    "big",
    "medium",
    "tiny",
    "huge",
    "shape",
    "shapes",
    "scene",
    "picture",
    "circle",
    "square",
    "triangle",
    "star",
    "ring",
    "cross",
    "diamond",
    "rectangle",
    "hexagon",
    "heart",
    "red",
    "green",
    "blue",
    "yellow",
    "orange",
    "purple",
    "pink",
    "white",
    "black",
    "gray",
    "grey",
    "brown",
    "cyan",
    "magenta",
    "up",
    "down",
    "moves",
    "slides",
    "drifts",
    "across",
    "one",
    "two",
    "draw",
    "show",
    "make",
    "image",
    "photo",
    "video",
    "clip",
    "of",
    "cat",
    "dog",
    "house",
    "tree",
    "sun",
    "moon",
    "car",
    "sky",
    "sea",
    ",",
    ".",
    ":",
    ";",
    "!",
    "?",
    "-",
    "'",
    "0",
    "1",
    "2",
    "3",
    "4",
    "5",
    "6",
    "7",
    "8",
    "9",
]


def vocabulary() -> list[str]:
    seen: dict[str, None] = dict.fromkeys(SPECIALS)
    seen.update(dict.fromkeys(WORDS))
    return list(seen)


def build_tokenizer(max_length: int = MAX_TEXT_TOKENS) -> Any:
    """A word-level tokenizer made with the `tokenizers` library (lower-cased, unknown -> <unk>).

    The text encoders of the tiny diffusion models get `<s> text </s>` (the rewriter has its own
    byte-level tokenizer: models/tiny_llm.py).
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    specials = [("<s>", vocab["<s>"]), ("</s>", vocab["</s>"])]
    single = "<s> $A </s>"
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        sep_token="<sep>",
        model_max_length=max_length,
    )


def _clip_text_encoder(vocab_size: int, tokenizer: Any) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel

    return CLIPTextModel(
        CLIPTextConfig(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=MAX_TEXT_TOKENS,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )


def tiny_image_vae() -> Any:
    """The tiny image models' KL VAE: 64x64 images, 16x16x4 latents (random weights)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(32, 64, 64),
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        norm_num_groups=16,
        sample_size=64,
    )


def image_pipeline() -> Any:
    """The tiny text-to-image architecture: 64x64 images, 16x16x4 latents (random weights)."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel

    tokenizer = build_tokenizer()
    unet = UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        block_out_channels=(64, 96),
        down_block_types=("CrossAttnDownBlock2D",) * 2,
        up_block_types=("CrossAttnUpBlock2D",) * 2,
        cross_attention_dim=64,
        attention_head_dim=8,
        norm_num_groups=16,
    )
    scheduler = DDIMScheduler(**SD_SCHEDULER)
    return StableDiffusionPipeline(
        vae=tiny_image_vae(),
        text_encoder=_clip_text_encoder(len(tokenizer), tokenizer),
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def _build_image(out: str) -> None:
    import torch

    torch.manual_seed(0)
    image_pipeline().save_pretrained(out)


def video_pipeline() -> Any:
    """The tiny text-to-video architecture (Wan): 9x64x64 clips -> 8x5x16x16 latents."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    tokenizer = build_tokenizer()
    vae = AutoencoderKLWan(
        base_dim=16,
        z_dim=8,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        scale_factor_spatial=4,
        scale_factor_temporal=2,
        latents_mean=[0.0] * 8,
        latents_std=[1.0] * 8,
    )
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=4,
        attention_head_dim=32,
        in_channels=8,
        out_channels=8,
        text_dim=64,
        freq_dim=64,
        ffn_dim=256,
        num_layers=4,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    )
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
        )
    )
    return WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        transformer=transformer,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )


def _build_video(out: str) -> None:
    import torch

    torch.manual_seed(0)
    video_pipeline().save_pretrained(out)


_BUILDERS: dict[str, Callable[[str], None]] = {
    "tiny-llm": build_llm,
    "tiny-image": _build_image,
    "tiny-video": _build_video,
}


def shipped_path(name: str) -> str | None:
    """Trained weights inside the package, if this build ships them."""
    path = resources.files("vllm_omni_like") / "assets" / name
    return str(path) if path.is_dir() else None


def ensure_tiny_model(name: str) -> str:
    """The directory of an embedded model; built (atomically, once) if nothing ships it."""
    if name not in _BUILDERS:
        raise KeyError(f"unknown embedded model {name!r}; known: {', '.join(TINY_NAMES)}")
    shipped = shipped_path(name)
    if shipped is not None:
        return shipped
    final = os.path.join(cache_dir(), f"{name}-v{BUILD_VERSION}")
    if os.path.isdir(final):
        return final
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir())
    try:
        _BUILDERS[name](tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first: theirs is identical
            if not os.path.isdir(final):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
