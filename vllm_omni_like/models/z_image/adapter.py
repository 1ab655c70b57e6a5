"""The Z-Image family in a worker.

Text: the pipeline's own encoding (Qwen3's chat template, its second-to-last hidden states),
each prompt at its own token count: kept padded with zeros to a length bucket for the loop's
row bookkeeping, with each row's count on the host (`lengths`), so a forward hands the
transformer each row's own tokens (its list input) without reading anything back from the
device. Latents: float32, (rows, C, h, w) as the pipeline keeps them; a forward gives each row
one frame in the transformer's dtype and its timestep as `(1000 - t) / 1000`; the velocity comes
back negated, as the pipeline negates it. Guidance above 0: `cond + scale x (cond - uncond)`.
Edits (img2img, inpainting: models/mmdit.py `FlowEdits`) start from the upload's latents as
ZImageImg2ImgPipeline and ZImageInpaintPipeline encode it (`(x - shift) x scale`, the default
`encode_image`), our float32 latents noised to the strength's first step. Its Qwen3 compiles
layer by layer (`--compile-text-encoders`: one graph a caption bucket, shared by its 36 layers;
whole, each bucket compiled the 36 layers again: 245 s more start on an H100).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from vllm_omni_like.models.adapter import Guidance, vae_decoder_target
from vllm_omni_like.models.block_stack import BlockStack
from vllm_omni_like.models.mmdit import FlowEdits, ShiftedVAE
from vllm_omni_like.models.packing import latent_side
from vllm_omni_like.models.text_buckets import pad_tokens, prompt_within, text_bucket
from vllm_omni_like.models.z_image import FAMILY
from vllm_omni_like.models.z_image.sequence import (
    CAPTION_BUCKETS,
    CAPTION_MULTIPLE,
    block_targets,
    key_mask,
    pad_sequences_to_buckets,
    use_zeroed_keys,
)
from vllm_omni_like.models.z_image.sequence_parallel import split_z_image
from vllm_omni_like.parallel.ulysses import SequenceShards

MAX_TEXT_TOKENS = 512  # ZImagePipeline's default `max_sequence_length`
# a main layer's arguments: the joint sequence [image, text, padding], then one row each
_LAYER_ARGS = ("attn_mask", "freqs_cis", "adaln_input", "noise_mask", "adaln_noisy", "adaln_clean")


class ZImageAdapter(ShiftedVAE, FlowEdits):
    family = FAMILY
    guidance = Guidance.TRUE_CFG  # (branches of their own lengths: one list a forward)
    cfg_above = 0.0  # ZImagePipeline guides at any scale above 0
    text_encoders_by_block = True  # (Qwen3 read at each caption bucket: a layer compiles)

    def text_embed_dim(self) -> int:
        return int(self.pipe.transformer.config.cap_feat_dim)

    def encode_text(self, texts: list[str | None], device: torch.device, max_length: int) -> Any:
        """ZImagePipeline._encode_prompt's states (its chat template, Qwen3's second-to-last
        hidden states of each prompt's tokens), Qwen3 run at the caption bucket of the longest
        prompt instead of the pipeline's 512 tokens: a causal encoder, its prompts padded on
        the right, so the padding changes none of a prompt's states (the bucket is a shape the
        warm-up ran: compiled, nothing compiles on a request). Each prompt's token count comes
        from the tokenizer's mask on the host (the pipeline selects the tokens by a boolean
        mask on the device: a sync a call); the padding's states are zeros."""
        pipe = self.pipe
        if pipe.tokenizer.padding_side != "right":  # (its prompts at the end: as the pipeline)
            return self._pipeline_text(texts, device)
        chats = [_chat(pipe.tokenizer, t or "") for t in texts]
        tokens = pipe.tokenizer(
            chats,
            padding="max_length",
            max_length=MAX_TEXT_TOKENS,
            truncation=True,
            return_tensors="pt",
        )
        lengths = [int(n) for n in tokens.attention_mask.sum(dim=1).tolist()]  # (on the host)
        bucket = text_bucket(max(lengths), CAPTION_BUCKETS)
        ids = tokens.input_ids[:, :bucket].to(device)
        keys = tokens.attention_mask[:, :bucket].to(device).bool()
        states = pipe.text_encoder(
            input_ids=ids, attention_mask=keys, output_hidden_states=True
        ).hidden_states[-2]
        mask = key_mask(lengths, bucket, states.device)
        embeds = states * mask.unsqueeze(-1).to(states.dtype)
        text = {"embeds": embeds, "mask": mask.long(), "lengths": torch.tensor(lengths)}
        return pad_tokens(text, bucket)

    def _pipeline_text(self, texts: list[str | None], device: torch.device) -> Any:
        """The pipeline's own encoding at 512 tokens, padded to the bucket of the longest."""
        rows = self.pipe._encode_prompt(
            prompt=[t or "" for t in texts], device=device, max_sequence_length=MAX_TEXT_TOKENS
        )
        lengths = [int(r.shape[0]) for r in rows]
        bucket = text_bucket(max(lengths), CAPTION_BUCKETS)
        embeds = torch.stack(
            [torch.cat([r, r.new_zeros((bucket - r.shape[0], r.shape[1]))]) for r in rows]
        )
        mask = key_mask(lengths, bucket, embeds.device).long()
        text = {"embeds": embeds, "mask": mask, "lengths": torch.tensor(lengths)}
        return pad_tokens(text, bucket)

    def warm_up_prompts(self, device: torch.device) -> tuple[str | tuple[str, ...], ...]:
        """Each caption bucket's two shapes (tokens counted by the pipeline's own encoding):
        rows whose captions fill it (no mask), and a padded one (a mask): a prompt shorter than
        the bucket where one is, else (every caption of 33-64 tokens fills 64) rows of the
        bucket's prompt beside rows of the smallest bucket's."""
        count = functools.cache(lambda p: int(self.encode_text([p], device, 0)["lengths"][0]))
        groups: list[str | tuple[str, ...]] = []
        smallest = None
        for low, high in zip((0, *CAPTION_BUCKETS), CAPTION_BUCKETS, strict=False):
            full = prompt_within(count, max(low, high - CAPTION_MULTIPLE), high)
            if full is None:  # (past the encoder's truncation, or within its template)
                continue
            groups.append(full)
            smallest = smallest or full
            short = prompt_within(count, low, high - CAPTION_MULTIPLE)
            if short is not None:
                groups.append(short)
            elif full != smallest:
                groups.append((full, smallest))
        return tuple(groups)

    def warmed_up(self) -> None:
        """A compiled stage's warm-up ran every shape: unmasked forwards only where it ran them."""
        pad_sequences_to_buckets(self.pipe.transformer).frozen = True

    def text_kwargs(
        self, prompts: list[str], negatives: list[str], tokenizer: Any
    ) -> dict[str, Any]:
        # copies: ZImagePipeline writes each prompt's chat template into the list it gets
        return {"prompt": list(prompts), "negative_prompt": list(negatives)}

    def compile_targets(self) -> list[tuple[Any, str]]:
        """Its blocks one by one (sequence.py: the eager padding between them gives them one
        shape per text bucket) and the VAE's decoder."""
        return [*block_targets(self.pipe.transformer), *vae_decoder_target(self.pipe)]

    def block_stack(self) -> BlockStack:
        """Its main layers over the joint sequence (not the refiners before them), called by
        position; a row's sequence is padded to its batch's text bucket, so a row whose peers
        change its bucket measures nothing that step and runs them."""
        layers = self.pipe.transformer.layers
        return BlockStack((layers,), ("x", *_LAYER_ARGS), ("x",), _LAYER_ARGS, hidden="x")

    def high_precision_layers(self) -> tuple[str, ...]:
        """FP8: the attention projections and the SwiGLU MLPs (`w1`, `w2`, `w3`) of the main
        layers and of both refiners. Kept: the embedders (`all_x_embedder`: the patches' 64
        features, `cap_embedder`: Qwen3's states, `t_embedder`, whose first layer's dtype sets
        the dtype of its sinusoids), each layer's `adaLN_modulation` (one row a sample) and
        `all_final_layer` (the prediction itself)."""
        return (
            "all_x_embedder.*",
            "cap_embedder.*",
            "t_embedder.*",
            "*.adaLN_modulation.*",
            "all_final_layer.*",
        )

    def split_sequence(self, shards: SequenceShards) -> int:
        """The unified sequence [image, caption] of the main layers split, the refiners whole
        (models/z_image/sequence_parallel.py). Its sequences padded to caption buckets here, on
        every rank: rank 0's `predict` meets the transformer wrapped, the others never run it."""
        pad_sequences_to_buckets(self.pipe.transformer)
        split_z_image(self.pipe.transformer, shards)
        return int(self.pipe.transformer.config.n_heads)

    def fast_attention(self) -> str | None:
        return "zeroed padding keys" if use_zeroed_keys(self.pipe.transformer) else None

    def latent_dtype(self, text_dtype: torch.dtype) -> torch.dtype:
        return torch.float32  # ZImagePipeline.prepare_latents

    def schedule_args(self, scheduler: Any, steps: int, width: int, height: int) -> dict[str, Any]:
        """ZImagePipeline's sigmas (torch's linspace, 1 down to 1/steps) and shift `mu`."""
        if type(scheduler).__name__ != "FlowMatchEulerDiscreteScheduler":
            return {}
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift
        from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

        config, factor = scheduler.config, self.pipe.vae_scale_factor
        tokens = (latent_side(height, factor) // 2) * (latent_side(width, factor) // 2)
        mu = calculate_shift(
            tokens,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        return {"sigmas": get_default_z_image_sigmas(steps), "mu": mu}

    def latent_shape(self, rows: int, width: int, height: int, frames: int = 1) -> tuple[int, ...]:
        factor = self.pipe.vae_scale_factor
        channels = self.pipe.transformer.in_channels
        return (rows, channels, latent_side(height, factor), latent_side(width, factor))

    def predict(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text: Any,
        at: Any = None,
        guidance: torch.Tensor | None = None,
    ) -> Any:
        transformer = self.pipe.transformer
        pad_sequences_to_buckets(transformer)  # (once: our loop's transformer, not a reference's)
        frames = list(latents.to(transformer.dtype).unsqueeze(2).unbind(dim=0))
        embeds = text["embeds"]
        tokens = [embeds[i, :n] for i, n in enumerate(text["lengths"].tolist())]
        out = transformer(frames, (1000 - timestep) / 1000, tokens, return_dict=False)[0]
        return -torch.stack([o.float() for o in out]).squeeze(2)

    def guide(
        self, cond: torch.Tensor, uncond: torch.Tensor, scale: float | torch.Tensor
    ) -> torch.Tensor:
        """ZImagePipeline's guidance: from the conditional branch, away from the other."""
        diff = cond - uncond
        if isinstance(scale, torch.Tensor):
            return cond + (scale * diff).to(diff.dtype)
        return cond + scale * diff


def _chat(tokenizer: Any, prompt: str) -> str:
    """A prompt in Qwen3's chat template, as ZImagePipeline writes it."""
    message = [{"role": "user", "content": prompt}]
    chat: str = tokenizer.apply_chat_template(
        message, tokenize=False, add_generation_prompt=True, enable_thinking=True
    )
    return chat


ADAPTER = ZImageAdapter
