"""The Stable Diffusion 3 family in a worker (SD3.5-medium, SD3.5-large).

The text: two CLIPs' penultimate states side by side (padded to T5's width) before T5's
tokens, and both CLIPs' pooled embeddings (`encode_prompt`); a negative prompt not given is
the empty prompt, as the pipeline encodes it. The transformer takes each row's timestep as the
scheduler gives it. Classifier-free guidance doubles the batch (one forward a step), as the
pipeline does.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_omni_like.models.adapter import Guidance
from vllm_omni_like.models.mmdit import MMDiT
from vllm_omni_like.models.sd3 import FAMILY
from vllm_omni_like.models.sd3.sequence_parallel import split_sd3
from vllm_omni_like.parallel.cfg_parallel import Leader, SplitCFG
from vllm_omni_like.parallel.ulysses import SequenceShards

MAX_TEXT_TOKENS = 256  # StableDiffusion3Pipeline's default T5 length


class SD3Adapter(MMDiT):
    family = FAMILY
    t5_tokenizer, max_text_tokens = "tokenizer_3", MAX_TEXT_TOKENS
    guidance = Guidance.BATCHED

    def encode_text(self, texts: list[str | None], device: torch.device, max_length: int) -> Any:
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=[t or "" for t in texts],
            prompt_2=None,
            prompt_3=None,
            device=device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=False,
            max_sequence_length=self.text_length(),
        )
        return {"embeds": embeds, "pooled": pooled}

    def text_kwargs(
        self, prompts: list[str], negatives: list[str], tokenizer: Any
    ) -> dict[str, Any]:
        return {
            "prompt": prompts,
            "negative_prompt": negatives,
            "max_sequence_length": self.text_length(),
        }

    def predict(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text: Any,
        at: Any = None,
        guidance: torch.Tensor | None = None,
    ) -> Any:
        return self.pipe.transformer(
            hidden_states=latents,
            timestep=timestep,
            encoder_hidden_states=text["embeds"],
            pooled_projections=text["pooled"],
            return_dict=False,
        )[0]

    def high_precision_layers(self) -> tuple[str, ...]:
        """FP8: every block's attention projections (both streams) and MLPs. Kept, as in FLUX.1:
        `context_embedder` and `time_text_embed` (the text's and the timestep's first layers),
        each block's AdaLayerNorm modulation (`norm1`, `norm1_context`: one row a sample) and the
        final `norm_out` and `proj_out` (the prediction itself)."""
        return (
            "context_embedder",
            "time_text_embed.*",
            "*.norm1.linear",
            "*.norm1_context.linear",
            "norm_out.linear",
            "proj_out",
        )

    def latent_shape(self, rows: int, width: int, height: int, frames: int = 1) -> tuple[int, ...]:
        factor = self.pipe.vae_scale_factor
        channels = self.pipe.transformer.config.in_channels
        return (rows, channels, height // factor, width // factor)

    def fuse_qkv(self) -> bool:
        """diffusers' fused processor (FusedJointAttnProcessor2_0) leaves out the QK norms and
        cannot run MMDiT-X's image-only attention: SD3.5's projections (every SD3.5 norms its
        queries and keys; medium's blocks have the second attention) stay unfused."""
        config = self.pipe.transformer.config
        if config.qk_norm is not None or config.dual_attention_layers:
            return False
        return super().fuse_qkv()

    def split_sequence(self, shards: SequenceShards) -> int:
        """The image's patch tokens split, the text whole (models/sd3/sequence_parallel.py)."""
        split_sd3(self.pipe.transformer, shards)
        return int(self.pipe.transformer.config.num_attention_heads)

    def split_cfg(self, leader: Leader) -> SplitCFG:
        """The pipeline doubles its batch: each rank runs one half."""
        wrapper = SplitCFG(self.pipe.transformer, leader)
        self.pipe.transformer = wrapper
        return wrapper


ADAPTER = SD3Adapter
