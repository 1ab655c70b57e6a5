"""The Qwen-Image-Edit family in a worker: edits by instruction through the pipeline's own call.

QwenImageEditPipeline fits the image to about a megapixel at its aspect ratio, reads each prompt
with it through Qwen2.5-VL (its chat template with the image's vision tokens; the first 64
tokens cut), and appends the image's latent tokens to the noise's at every step (true CFG, its
negative prompt also read with the image). Rows of a batch are whole
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
        """The model itself (it only edits): each row's image fitted as its single-image call
        fits one, its texts padded to text buckets."""
        fit_each_image(self.pipe)
        pad_encoded_prompts(self.pipe)
        return {Mode.EDIT: self.pipe}


def pad_encoded_prompts(pipe: Any) -> None:
    """The pipeline's `encode_prompt` with its texts (the prompt and the upload's vision
    tokens, about 1,370 at a megapixel) padded on to their text bucket with a mask, as
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


def fit_each_image(pipe: Any) -> None:
    """Each image of a list fitted as the pipeline's call fits a single one, once per pipeline.

    The call fits its image (`image_processor.resize`: about a megapixel, a multiple of 32) for
    Qwen2.5-VL and the VAE, but passes a list - the stage's, one image a row - through as it is:
    Qwen2.5-VL would read each raw upload (a small one in tens of vision tokens, a 12-megapixel
    photo in about 15,000, against about 1,370 at a megapixel). The call fits every image to the
    first's size; a batch holds one upload size (the batching key), so each row is what its own
    single-image call makes."""
    processor = pipe.image_processor
    if getattr(processor, "_fits_each", False):
        return
    resize = processor.resize

    def resize_each(image: Any, height: int, width: int, resize_mode: str = "default") -> Any:
        if isinstance(image, list):
            return [resize(i, height, width, resize_mode) for i in image]
        return resize(image, height, width, resize_mode)

    processor.resize = resize_each
    processor._fits_each = True


ADAPTER = QwenImageEditAdapter
