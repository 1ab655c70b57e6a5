"""The Qwen-Image-Edit family in a worker: edits by instruction through the pipeline's own call.

QwenImageEditPipeline reads each prompt with its image through Qwen2.5-VL (its chat template
with the image's vision tokens; the first 64 tokens cut), fits the image to about a megapixel
at its aspect ratio for the VAE, and appends the image's latent tokens to the noise's at every
step (true CFG, its negative prompt also read with the image). Rows of a batch are whole
requests of one size and step count (the batching key): the pipeline's call runs them. What
Qwen-Image's adapter knows - the text and guidance arguments, the latents' packing, the decode
- holds here unchanged.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from vllm_omni_like.models.adapter import pad_tokens
from vllm_omni_like.models.qwen_image import EDIT_FAMILY
from vllm_omni_like.models.qwen_image.adapter import QwenImageAdapter
from vllm_omni_like.models.qwen_image.vl_processor import VisionTextProcessor
from vllm_omni_like.models.text_buckets import text_bucket
from vllm_omni_like.wire import Mode


class QwenImageEditAdapter(QwenImageAdapter):
    family = EDIT_FAMILY
    image_conditions = ("edit",)

    @classmethod
    def own_components(cls, path: str) -> dict[str, Any]:
        """The processor loads here (models/qwen_image/vl_processor.py says why)."""
        return {"processor": VisionTextProcessor.load(os.path.join(path, "processor"))}

    def edit_pipelines(self, stage: str) -> dict[str, Any]:
        """The model itself (it only edits), its texts padded to text buckets."""
        pad_encoded_prompts(self.pipe)
        return {Mode.EDIT: self.pipe}


def pad_encoded_prompts(pipe: Any) -> None:
    """The pipeline's `encode_prompt` with its texts (the prompt and the upload's vision
    tokens, about 330 at a megapixel) padded on to their text bucket with a mask, as
    Qwen-Image's own loop pads them (masked zeros: the same result), so a compiled transformer
    sees one text shape a bucket instead of one a prompt length; once per pipeline."""
    if getattr(pipe, "_text_buckets", False):
        return
    encode = pipe.encode_prompt

    def encode_prompt(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, mask = encode(*args, **kwargs)
        if mask is None:  # (the pipeline drops a mask of all ones)
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        text = pad_tokens({"embeds": embeds, "mask": mask}, text_bucket(embeds.shape[1]))
        return text["embeds"], text["mask"]

    pipe.encode_prompt = encode_prompt
    pipe._text_buckets = True


ADAPTER = QwenImageEditAdapter
