"""SDXL in a worker: the UNet family's adapter with SDXL's conditioning. Two text encoders (the
penultimate states of both side by side, the second's pooled embedding; a negative prompt not
given is zeros where the model says `force_zeros_for_empty_prompt`), the size and crop
conditioning (`time_ids`), and a VAE decoding in float32 where its config asks it to
(`force_upcast`: a float32 copy kept beside the float16 one, so a decode never changes the
model another thread may be using). Its two CLIPs compile (`--compile-text-encoders`) with graph
breaks where transformers sets up the hooks that record their hidden states (the pipeline asks
for them: the breaks are outside the layers, which compile whole)."""

from __future__ import annotations

import copy
from typing import Any

import torch

from vllm_omni_like.models import image_latents
from vllm_omni_like.models.adapter import Decoder, is_image_vae
from vllm_omni_like.models.stable_diffusion import XL_FAMILY
from vllm_omni_like.models.stable_diffusion.adapter import StableDiffusionAdapter


class StableDiffusionXLAdapter(StableDiffusionAdapter):
    family = XL_FAMILY

    def __init__(self, pipe: Any, family: Any = None) -> None:
        super().__init__(pipe, family)
        self._time_ids: dict[tuple[Any, ...], torch.Tensor] = {}
        vae: Any = getattr(pipe, "vae", None)
        upcast = vae is not None and vae.dtype == torch.float16 and vae.config.force_upcast
        self._vae32 = copy.deepcopy(vae).to(torch.float32) if upcast else None
        self._encoder32: Any = None  # (an edit's encode in float32: made on the first)

    def text_embed_dim(self) -> int:
        return int(self.pipe.unet.config.cross_attention_dim)

    def encode_text(self, texts: list[str | None], device: torch.device, max_length: int) -> Any:
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=[t or "" for t in texts],
            device=device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=False,
        )
        absent = [i for i, t in enumerate(texts) if t is None]
        if absent and self.pipe.config.force_zeros_for_empty_prompt:
            embeds[absent], pooled[absent] = 0.0, 0.0
        return {"embeds": embeds, "pooled": pooled}

    def text_kwargs(
        self, prompts: list[str], negatives: list[str], tokenizer: Any
    ) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"prompt": prompts}
        if any(negatives):  # (none given: the pipeline's own, zeros)
            kwargs["negative_prompt"] = negatives
        return kwargs

    def predict(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text: Any,
        at: Any = None,
        guidance: torch.Tensor | None = None,
    ) -> Any:
        embeds, pooled = text["embeds"], text["pooled"]
        ids = self._ids(latents, embeds.dtype, pooled).expand(latents.shape[0], -1)
        return self.pipe.unet(
            latents,
            timestep,
            encoder_hidden_states=embeds,
            added_cond_kwargs={"text_embeds": pooled, "time_ids": ids},
            return_dict=False,
        )[0]

    def _ids(self, latents: torch.Tensor, dtype: torch.dtype, pooled: torch.Tensor) -> Any:
        """The pipeline's `add_time_ids` for this size: original = target size, no crop."""
        factor = self.pipe.vae_scale_factor
        size = (latents.shape[-2] * factor, latents.shape[-1] * factor)
        key = (size, dtype, latents.device)
        if key not in self._time_ids:
            encoder = getattr(self.pipe, "text_encoder_2", None)
            dim = encoder.config.projection_dim if encoder is not None else pooled.shape[-1]
            from diffusers import StableDiffusionXLPipeline

            # (the text-to-image pipeline's: an inpainting checkpoint's pipeline has its own,
            # with aesthetic scores, whose ids are these where it does not require them)
            get = StableDiffusionXLPipeline._get_add_time_ids
            ids = get(self.pipe, size, (0, 0), size, dtype, int(dim))
            self._time_ids[key] = ids.to(latents.device)
        return self._time_ids[key]

    def encode_image(self, pixels: torch.Tensor, generator: torch.Generator | None) -> Any:
        """StableDiffusionXLImg2ImgPipeline's: in float32 where the VAE's config says
        `force_upcast` (a float32 copy, made once: the pipeline casts its own VAE, which another
        thread may be decoding with), in the latents' dtype after."""
        vae = self.pipe.vae
        if not vae.config.force_upcast or vae.dtype == torch.float32:
            return super().encode_image(pixels, generator)
        if self._encoder32 is None:
            self._encoder32 = self._vae32 or copy.deepcopy(vae).to(torch.float32)
        return image_latents.encode(self._encoder32, pixels.float(), generator, vae.dtype)

    def decoder(self, pipe: Any) -> Decoder | None:
        if not is_image_vae(pipe.vae):
            return None
        return lambda latents: self._decode(pipe, latents)

    def preview(self, pipe: Any) -> Decoder | None:
        return self.decoder(pipe)

    def _decode(self, pipe: Any, latents: torch.Tensor) -> torch.Tensor:
        """StableDiffusionXLPipeline's decode: float32 where the VAE asks, the latents' mean
        and spread where its config has them, the watermark where one is installed."""
        vae = pipe.vae
        if self._vae32 is not None:
            vae, latents = self._vae32, latents.to(torch.float32)
        config = vae.config
        if getattr(config, "latents_mean", None) is not None and config.latents_std is not None:
            shape = (1, len(config.latents_mean), 1, 1)
            mean = torch.tensor(config.latents_mean).view(shape).to(latents.device, latents.dtype)
            std = torch.tensor(config.latents_std).view(shape).to(latents.device, latents.dtype)
            latents = latents * std / config.scaling_factor + mean
        else:
            latents = latents / config.scaling_factor
        image = vae.decode(latents, return_dict=False)[0]
        if getattr(pipe, "watermark", None) is not None:
            image = pipe.watermark.apply_watermark(image)
        pixels: torch.Tensor = pipe.image_processor.postprocess(image, output_type="pt")
        return pixels


ADAPTER = StableDiffusionXLAdapter
