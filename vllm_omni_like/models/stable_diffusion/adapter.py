"""The Stable Diffusion UNet family in a worker (SD1.5, the tiny image model).

An inpainting checkpoint's UNet takes 9 channels (SD1.5's and SDXL's inpainting models): the
latents, then the mask at the latents' size, then the masked image's latents, concatenated for
each forward after the scheduler scales the latents, as StableDiffusion(XL)InpaintPipeline does;
its latents are the VAE's channels (`takes_mask`, `predict_conditioned`)."""

from __future__ import annotations

from typing import Any

import torch

from vllm_omni_like.models.adapter import (
    Adapter,
    Decoder,
    Guidance,
    auto_edit_pipelines,
    fuse_unet_qkv,
    is_image_vae,
    nhwc_unet_and_image_vae,
    split_unet_batch,
    unet_compile_targets,
)
from vllm_omni_like.models.stable_diffusion import FAMILY
from vllm_omni_like.parallel.cfg_parallel import Leader, SplitCFG


class StableDiffusionAdapter(Adapter):
    family = FAMILY
    guidance = Guidance.BATCHED  # the pipeline doubles the batch: one UNet forward a step
    image_conditions = ("edit", "inpaint")

    def predict(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text: Any,
        at: Any = None,
        guidance: torch.Tensor | None = None,
    ) -> Any:
        unet = self.pipe.unet
        return unet(latents, timestep, encoder_hidden_states=text, return_dict=False)[0]

    def takes_mask(self) -> bool:
        """The family's rule on this pipeline's configs (what `/v1/models` says it runs)."""
        unet, vae = self.pipe.unet, getattr(self.pipe, "vae", None)
        return vae is not None and self.family.takes_mask(unet.config, vae.config)

    def predict_conditioned(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text: Any,
        conditioning: Any,
        at: Any = None,
    ) -> Any:
        """A 9-channel UNet's forward: the mask and masked image's latents after the latents."""
        joined = torch.cat([latents, conditioning["mask"], conditioning["masked_image"]], dim=1)
        return self.predict(joined, timestep, text, at=at)

    def encode_text(self, texts: list[str | None], device: torch.device, max_length: int) -> Any:
        return self.pipe.encode_prompt([t or "" for t in texts], device, 1, False)[0]

    def latent_shape(self, rows: int, width: int, height: int, frames: int = 1) -> tuple[int, ...]:
        factor = self.pipe.vae_scale_factor
        channels = self.pipe.unet.config.in_channels  # (an inpainting UNet's: the VAE's)
        channels = self.pipe.vae.config.latent_channels if self.takes_mask() else channels
        return (rows, channels, height // factor, width // factor)

    def decoder(self, pipe: Any) -> Decoder | None:
        # an AsymmetricAutoencoderKL's decode (inpainting) also takes the masked input image
        if not is_image_vae(pipe.vae):
            return None
        return lambda latents: _decode(pipe, latents)

    def preview(self, pipe: Any) -> Decoder | None:
        def decode(latents: torch.Tensor) -> torch.Tensor:
            vae = pipe.vae
            images = vae.decode(latents / vae.config.scaling_factor, return_dict=False)[0]
            pixels: torch.Tensor = pipe.image_processor.postprocess(images, output_type="pt")
            return pixels

        return decode

    def edit_pipelines(self, stage: str) -> dict[str, Any]:
        return auto_edit_pipelines(self.pipe, stage)

    def fuse_qkv(self) -> bool:
        return fuse_unet_qkv(self.pipe)

    def channels_last(self, compiled: bool, forced: bool) -> bool:
        return nhwc_unet_and_image_vae(self.pipe, compiled, forced)

    def compile_targets(self) -> list[tuple[Any, str]]:
        return unet_compile_targets(self.pipe)

    def split_cfg(self, leader: Leader) -> SplitCFG:
        return split_unet_batch(self.pipe, leader)


def _decode(pipe: Any, latents: torch.Tensor) -> torch.Tensor:
    """StableDiffusionPipeline's decode: the VAE, the safety checker, the post-processing."""
    vae = pipe.vae
    image = vae.decode(latents / vae.config.scaling_factor, return_dict=False)[0]
    # the pipeline passes its prompt embeddings' dtype, which its latents were made in
    image, nsfw = pipe.run_safety_checker(image, image.device, latents.dtype)
    denormalize = [True] * image.shape[0] if nsfw is None else [not flagged for flagged in nsfw]
    pixels: torch.Tensor = pipe.image_processor.postprocess(
        image, output_type="pt", do_denormalize=denormalize
    )
    return pixels


ADAPTER = StableDiffusionAdapter
