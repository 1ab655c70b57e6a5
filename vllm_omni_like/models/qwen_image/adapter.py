"""The Qwen-Image family in a worker.

Text: the pipeline's own encoding (its chat template, Qwen2.5-VL's last hidden states, the
system prompt's tokens cut off), each prompt at its own length with a mask, padded with masked
zeros to a length bucket (models/text_buckets.py), so rows of many requests share one forward and a
compiled transformer sees few shapes; a padded token is masked out, so a row's result does not
depend on its neighbours' lengths. A negative prompt not given is " " (what Qwen-Image is shown
with: the pipeline runs true CFG only with a negative prompt). Latents: unpacked in our loop,
packed per forward (models/packing.py), one frame of the video VAE. Guidance: true CFG, both
branches in one forward (their lengths differ: the mask), the guided velocity rescaled per
token to the conditional one's norm, as the pipeline does. Edits (img2img, inpainting: models/
mmdit.py `FlowEdits`) start from the upload's latents as QwenImageImg2ImgPipeline and
QwenImageInpaintPipeline encode it: one frame through the video VAE, normalised by its mean and
spread (`encode_image`).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_omni_like.errors import ConfigError
from vllm_omni_like.models.adapter import Decoder, Guidance
from vllm_omni_like.models.block_stack import BlockStack, joint_stack
from vllm_omni_like.models.mmdit import FlowEdits, PackedLatents
from vllm_omni_like.models.packing import pack, unpack
from vllm_omni_like.models.qwen_image import FAMILY
from vllm_omni_like.models.qwen_image.sequence_parallel import split_qwen_image
from vllm_omni_like.models.text_buckets import bucket_prompts, pad_tokens, text_bucket
from vllm_omni_like.parallel.ulysses import SequenceShards
from vllm_omni_like.params import GenerationParams

MAX_TEXT_TOKENS = 512  # QwenImagePipeline's default `max_sequence_length`
NO_NEGATIVE = " "


_PER_ROW = ("encoder_hidden_states_mask", "temb")  # a block's arguments with a row each


class QwenImageAdapter(PackedLatents, FlowEdits):
    family = FAMILY
    guidance = Guidance.TRUE_CFG

    def text_embed_dim(self) -> int:
        return int(self.pipe.transformer.config.joint_attention_dim)

    def encode_text(self, texts: list[str | None], device: torch.device, max_length: int) -> Any:
        embeds, mask = self.pipe.encode_prompt(
            prompt=[NO_NEGATIVE if t is None else t for t in texts],
            device=device,
            num_images_per_prompt=1,
            max_sequence_length=MAX_TEXT_TOKENS,
        )
        if mask is None:  # (every token is a prompt's: the pipeline leaves the mask out)
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return pad_tokens({"embeds": embeds, "mask": mask}, text_bucket(embeds.shape[1]))

    def warm_up_prompts(self, device: torch.device) -> tuple[str, ...]:
        """One a text bucket (its tokens counted by the pipeline's own encoding)."""
        return bucket_prompts(lambda p: int(self.encode_text([p], device, 0)["mask"].sum()))

    def text_kwargs(
        self, prompts: list[str], negatives: list[str], tokenizer: Any
    ) -> dict[str, Any]:
        return {
            "prompt": prompts,
            "negative_prompt": [n or NO_NEGATIVE for n in negatives],
            "max_sequence_length": MAX_TEXT_TOKENS,
        }

    def guidance_kwargs(
        self, scale: float, params: GenerationParams | None = None
    ) -> dict[str, Any]:
        return {"true_cfg_scale": scale}

    def predict(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text: Any,
        at: Any = None,
        guidance: torch.Tensor | None = None,
    ) -> Any:
        rows, _, h, w = latents.shape
        out = self.pipe.transformer(
            hidden_states=pack(latents),
            timestep=timestep.to(latents.dtype) / 1000,
            guidance=None,
            encoder_hidden_states_mask=text["mask"],
            encoder_hidden_states=text["embeds"],
            img_shapes=[[(1, h // 2, w // 2)]] * rows,
            return_dict=False,
        )[0]
        return unpack(out, h, w)

    def encode_image(self, pixels: torch.Tensor, generator: torch.Generator | None) -> Any:
        """The pipelines' `_encode_vae_image`: the upload as one frame of the video VAE, its
        sample drawn with the row's generator, `(x - mean) x (1 / std)`; (1, C, h, w)."""
        from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img import (
            retrieve_latents,
        )

        vae = self.pipe.vae
        frame = pixels.to(vae.dtype).unsqueeze(2)
        latents = retrieve_latents(vae.encode(frame), generator=generator)
        mean, inverse_std = _statistics(vae, latents)
        image: torch.Tensor = ((latents - mean) * inverse_std)[:, :, 0]
        return image

    def guide(
        self, cond: torch.Tensor, uncond: torch.Tensor, scale: float | torch.Tensor
    ) -> torch.Tensor:
        """True CFG, then each token's guided velocity scaled to the conditional one's norm."""
        guided = super().guide(cond, uncond, scale)
        h, w = cond.shape[-2:]
        tokens, guided_tokens = pack(cond), pack(guided)
        ratio = torch.norm(tokens, dim=-1, keepdim=True) / torch.norm(
            guided_tokens, dim=-1, keepdim=True
        )
        return unpack(guided_tokens * ratio, h, w)

    def high_precision_layers(self) -> tuple[str, ...]:
        """FP8: every block's attention projections (image and text streams) and MLPs
        (`img_mlp`, `txt_mlp`). Kept: `img_in` (64 packed latent features), `txt_in`
        (Qwen2.5-VL's states), `time_text_embed`, each block's modulation (`img_mod`, `txt_mod`:
        one row a sample, 6.8B of the 20.4B weights) and the final `norm_out` and `proj_out`."""
        return (
            "img_in",
            "txt_in",
            "time_text_embed.*",
            "*.img_mod.*",
            "*.txt_mod.*",
            "norm_out.linear",
            "proj_out",
        )

    def decoder(self, pipe: Any) -> Decoder | None:
        return lambda latents: _decode(pipe, latents)

    def preview(self, pipe: Any) -> Decoder | None:
        return self.decoder(pipe)

    def block_stack(self) -> BlockStack:
        """Its dual-stream blocks, each row's text mask beside its timestep embedding (a
        transformer whose embedding is two a row, `zero_cond_t`, is refused)."""
        transformer = self.pipe.transformer
        if getattr(transformer, "zero_cond_t", False):
            raise ConfigError("--cache first-block does not run a zero_cond_t Qwen-Image yet")
        return joint_stack(transformer.transformer_blocks, per_row=_PER_ROW)

    def compile_targets(self) -> list[tuple[Any, str]]:
        return [(self.pipe, "transformer")]

    def text_encoder_targets(self) -> list[tuple[Any, str]]:
        """None: Qwen2.5-VL reads each prompt at its own token count (the pipeline pads a batch
        to its longest; an edit's upload adds its vision tokens), a graph each: compiled, a
        new prompt length would compile on a request. Its encoder stays eager."""
        return []

    def split_sequence(self, shards: SequenceShards) -> int:
        """The image tokens split (Qwen-Image-Edit's: the noise's, then the upload's), the
        masked text whole (models/qwen_image/sequence_parallel.py)."""
        split_qwen_image(self.pipe.transformer, shards)
        return int(self.pipe.transformer.config.num_attention_heads)

    def fast_attention(self) -> str | None:
        from vllm_omni_like.models.qwen_image.attention import use_padded_text_attention

        done = use_padded_text_attention(self.pipe.transformer)
        return "padded_text_attention" if done else None


def _decode(pipe: Any, latents: torch.Tensor) -> torch.Tensor:
    """QwenImagePipeline's decode: one frame of the video VAE, un-normalised by its mean and
    spread, then the post-processing."""
    vae = pipe.vae
    latents = latents.unsqueeze(2).to(vae.dtype)
    mean, inverse_std = _statistics(vae, latents)
    image = vae.decode(latents / inverse_std + mean, return_dict=False)[0][:, :, 0]
    pixels: torch.Tensor = pipe.image_processor.postprocess(image, output_type="pt")
    return pixels


def _statistics(vae: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The video VAE's per-channel latent mean and 1 / std, shaped and typed for the frames
    `like` (B, C, 1, h, w), as the pipelines compute them."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(like.device, like.dtype)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(like.device, like.dtype)
    return mean, inverse_std


ADAPTER = QwenImageAdapter
