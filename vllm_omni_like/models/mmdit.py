"""What the transformer image families share in a worker (SD3, FLUX.1, Z-Image; Qwen-Image's
packed latents; the flow-matching img2img and inpainting rules of all four): adapter parts, one
place each."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from vllm_omni_like.models import image_latents
from vllm_omni_like.models.adapter import (
    Adapter,
    Decoder,
    auto_edit_pipelines,
    shifted_vae_decode,
    vae_decoder_target,
)
from vllm_omni_like.models.block_stack import BlockStack, joint_stack
from vllm_omni_like.models.packing import latent_side, shifted_flow_schedule, unpack


class ShiftedVAE(Adapter):
    """A 16-channel KL VAE scaled and shifted (SD3, FLUX.1, Z-Image): the pipeline's decode for
    images and previews; the transformer and the VAE's decoder compiled."""

    def decoder(self, pipe: Any) -> Decoder | None:
        return lambda latents: shifted_vae_decode(pipe, latents)

    def preview(self, pipe: Any) -> Decoder | None:
        return self.decoder(pipe)

    def compile_targets(self) -> list[tuple[Any, str]]:
        return [(self.pipe, "transformer"), *vae_decoder_target(self.pipe)]


class FlowEdits(Adapter):
    """SD3, FLUX.1, Qwen-Image and Z-Image: image-to-image and inpainting edits on our own loop
    as the family's flow-matching img2img and inpaint pipelines make them (their pipelines
    sharing the model: the processors our rows' sources are made with, the call of a loop not
    ours); a strength's steps by their `get_timesteps`."""

    image_conditions: ClassVar[tuple[str, ...]] = ("edit", "inpaint")

    def edit_pipelines(self, stage: str) -> dict[str, Any]:
        return auto_edit_pipelines(self.pipe, stage)

    def edit_steps(self, steps: int, strength: float) -> tuple[int, int]:
        return image_latents.fractional_steps(steps, strength)  # (their img2img pipelines')


class MMDiT(ShiftedVAE, FlowEdits):
    """SD3 and FLUX.1: T5's text length, diffusers' fused QKV projections, the joint blocks."""

    t5_tokenizer: str  # the pipeline's attribute holding T5's tokenizer
    max_text_tokens: int  # the pipeline's T5 length (its default or its limit)

    def text_embed_dim(self) -> int:
        return int(self.pipe.transformer.config.joint_attention_dim)

    def text_length(self) -> int:
        """T5's tokens a prompt is padded to: its tokenizer's length, at most the pipeline's."""
        tokenizer = getattr(self.pipe, self.t5_tokenizer, None)
        length = getattr(tokenizer, "model_max_length", self.max_text_tokens)
        return min(int(length), self.max_text_tokens)

    def fuse_qkv(self) -> bool:
        self.pipe.transformer.fuse_qkv_projections()
        return True

    def block_stack(self) -> BlockStack:
        """The joint blocks (FLUX.1: then its single-stream blocks, called alike)."""
        transformer = self.pipe.transformer
        singles = getattr(transformer, "single_transformer_blocks", None)
        lists = (transformer.transformer_blocks, *([singles] if singles is not None else []))
        return joint_stack(*lists)


class PackedLatents(Adapter):
    """FLUX.1 and Qwen-Image: 2x2-packed latents kept unpacked in our loop (models/packing.py),
    a flow schedule given the pipeline's sigmas and shifted by the image's token count."""

    def schedule_args(self, scheduler: Any, steps: int, width: int, height: int) -> dict[str, Any]:
        return shifted_flow_schedule(scheduler, steps, width, height, self.pipe.vae_scale_factor)

    def latent_shape(self, rows: int, width: int, height: int, frames: int = 1) -> tuple[int, ...]:
        factor = self.pipe.vae_scale_factor
        channels = self.pipe.transformer.config.in_channels // 4
        return (rows, channels, latent_side(height, factor), latent_side(width, factor))

    def loop_latents(self, latents: torch.Tensor, width: int, height: int) -> torch.Tensor:
        if latents.dim() != 3:
            return latents
        factor = self.pipe.vae_scale_factor
        return unpack(latents, latent_side(height, factor), latent_side(width, factor))
