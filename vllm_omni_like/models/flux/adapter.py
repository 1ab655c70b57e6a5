"""The FLUX.1 family in a worker (FLUX.1-dev, FLUX.1-schnell).

Our loop keeps FLUX's latents unpacked (models/packing.py). `predict` packs them into tokens
for the transformer (with the image's position ids, made once a size) and unpacks its
velocity. The timestep goes
in as the pipeline gives it (in the latents' dtype, / 1000), the guidance scale of each row
into the guidance embedding (FLUX.1-dev; schnell has none). The schedule: the pipeline's
sigmas (1 down to 1/steps), shifted by the image's token count (`mu`) where the scheduler
shifts dynamically (dev).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_omni_like.models.adapter import Guidance
from vllm_omni_like.models.flux import FAMILY
from vllm_omni_like.models.flux.sequence_parallel import split_flux
from vllm_omni_like.models.mmdit import MMDiT, PackedLatents
from vllm_omni_like.models.packing import pack, unpack
from vllm_omni_like.parallel.ulysses import SequenceShards

MAX_TEXT_TOKENS = 512  # FluxPipeline's limit (and default) for the T5 tokens


class FluxAdapter(MMDiT, PackedLatents):
    family = FAMILY
    t5_tokenizer, max_text_tokens = "tokenizer_2", MAX_TEXT_TOKENS
    guidance = Guidance.DISTILLED  # (schnell: the embedding is absent, the scale unused)

    def __init__(self, pipe: Any, family: Any = None) -> None:
        super().__init__(pipe, family)
        self._image_ids: dict[tuple[Any, ...], torch.Tensor] = {}
        transformer = getattr(pipe, "transformer", None)
        self._embeds_guidance = bool(transformer and transformer.config.guidance_embeds)

    def encode_text(self, texts: list[str | None], device: torch.device, max_length: int) -> Any:
        embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=[t or "" for t in texts],
            prompt_2=None,
            device=device,
            num_images_per_prompt=1,
            max_sequence_length=self.text_length(),
        )
        return {"embeds": embeds, "pooled": pooled}

    def text_kwargs(
        self, prompts: list[str], negatives: list[str], tokenizer: Any
    ) -> dict[str, Any]:
        # (no negative prompt: FLUX.1's guidance is its embedding; true CFG is not served)
        return {"prompt": prompts, "max_sequence_length": self.text_length()}

    def predict(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text: Any,
        at: Any = None,
        guidance: torch.Tensor | None = None,
    ) -> Any:
        rows, _, h, w = latents.shape
        embeds = text["embeds"]
        if self._embeds_guidance and guidance is None:  # (one scale, the pipeline's default)
            guidance = torch.full((rows,), FAMILY.default_guidance, device=latents.device)
        out = self.pipe.transformer(
            hidden_states=pack(latents),
            timestep=timestep.to(latents.dtype) / 1000,
            guidance=guidance if self._embeds_guidance else None,
            pooled_projections=text["pooled"],
            encoder_hidden_states=embeds,
            txt_ids=torch.zeros(embeds.shape[1], 3, device=latents.device, dtype=embeds.dtype),
            img_ids=self._ids(h, w, latents.device, embeds.dtype),
            return_dict=False,
        )[0]
        return unpack(out, h, w)

    def high_precision_layers(self) -> tuple[str, ...]:
        """FP8: every block's attention projections (fused QKV too) and MLPs, the single
        blocks' `proj_mlp` and `proj_out` - all but a few percent of the FLOPs at 1024x1024
        beside attention itself. Kept: the embedders (`x_embedder` takes the 64 packed latent
        features, `context_embedder` T5's states, `time_text_embed` the timestep, guidance and
        pooled text), each block's AdaLayerNorm modulation (`norm1`, `norm1_context`, the single
        blocks' `norm`: one row a sample, 3.2B of the 11.9B weights but no FLOPs to speak of,
        scaling every activation of its block) and the final `norm_out` and `proj_out`."""
        return (
            "x_embedder",
            "context_embedder",
            "time_text_embed.*",
            "*.norm1.linear",
            "*.norm1_context.linear",
            "*.norm.linear",
            "norm_out.linear",
            "proj_out",
        )

    def split_sequence(self, shards: SequenceShards) -> int:
        """The image tokens split, the T5 text whole (models/flux/sequence_parallel.py)."""
        split_flux(self.pipe.transformer, shards)
        return int(self.pipe.transformer.config.num_attention_heads)

    def _ids(self, h: int, w: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The image tokens' position ids (FluxPipeline._prepare_latent_image_ids), once a size."""
        key = (h, w, device, dtype)
        if key not in self._image_ids:
            ids = self.pipe._prepare_latent_image_ids(1, h // 2, w // 2, device, dtype)
            self._image_ids[key] = ids
        return self._image_ids[key]


ADAPTER = FluxAdapter
