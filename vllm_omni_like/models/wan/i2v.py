"""Wan image to video in a worker (WanImageToVideoPipeline: Wan2.1-I2V with its CLIP image
encoder, Wan2.2-I2V-A14B's two experts), on our own loop: each row's conditioning is what the
pipeline's `prepare_latents` makes of its first frame - the frame mask (the first latent frame's
frames kept) beside the VAE latents of the frame followed by zeros (the VAE's mode: no random
numbers) - channel-concatenated after the noise's in every forward, and (Wan2.1) the frame's
CLIP features the transformer also attends to; both CFG branches take the same. What the Wan
adapter knows - experts and their boundary, text, decode, the chunked MP4 - holds unchanged.
The pipeline's own call stays for what our loop does not run (CFG-parallel ranks)."""

from __future__ import annotations

from typing import Any

import torch

from vllm_omni_like.models.row_conditions import Conditioning
from vllm_omni_like.models.wan import I2V_FAMILY
from vllm_omni_like.models.wan.adapter import WanAdapter
from vllm_omni_like.wire import Mode


class WanI2VAdapter(WanAdapter):
    family = I2V_FAMILY
    image_conditions = ("image",)
    branch_inputs = ("encoder_hidden_states_image",)  # (Wan2.1-I2V's CLIP features)
    conditioned = True

    def edit_pipelines(self, stage: str) -> dict[str, Any]:
        return {Mode.IMAGE2VIDEO: self.pipe}  # (the model itself: it only starts from an image)

    def condition(
        self, image: Any, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> Conditioning:
        """The first frame's condition (mask and latents) as the pipeline's `prepare_latents`
        makes it for latents of `shape`, and (Wan2.1) its CLIP features as `encode_image`
        makes them, in the transformer's dtype."""
        pipe = self.pipe
        _, channels, frames, h, w = shape
        height, width = h * pipe.vae_scale_factor_spatial, w * pipe.vae_scale_factor_spatial
        num_frames = (frames - 1) * pipe.vae_scale_factor_temporal + 1
        pixels = pipe.video_processor.preprocess(image, height=height, width=width)
        pixels = pixels.to(device, dtype=torch.float32)
        placeholder = torch.empty(0, device=device, dtype=dtype)  # (no noise drawn: the loop's)
        _, condition = pipe.prepare_latents(
            pixels, 1, channels, height, width, num_frames, dtype, device, None, placeholder
        )
        conditioning = {"condition": condition}
        if pipe.transformer.config.image_dim is not None:  # (Wan2.1-I2V's CLIP features)
            conditioning["image_embeds"] = pipe.encode_image(image, device).to(self._dtype)
        return conditioning

    def model_inputs(
        self,
        model: Any,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        conditioning: Conditioning | None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """The noise's latents with each row's condition after their channels; its CLIP
        features where it has them."""
        assert conditioning is not None  # (every row of this family has an image)
        hidden = torch.cat([latents, conditioning["condition"]], dim=1)
        more = {}
        if "image_embeds" in conditioning:
            more["encoder_hidden_states_image"] = conditioning["image_embeds"]
        return hidden, timestep, more


ADAPTER = WanI2VAdapter
