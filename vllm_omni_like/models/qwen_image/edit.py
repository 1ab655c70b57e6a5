"""The Qwen-Image-Edit family in a worker: edits by instruction on our own loop.

QwenImageEditPipeline fits the upload to about a megapixel at its aspect (multiples of 32), reads
each prompt with it through Qwen2.5-VL (its chat template with the image's vision tokens; the
first 64 tokens cut), and puts the upload's latent tokens after the noise's in every forward
(true CFG: its negative prompt also read with the image, both branches given the same image
tokens), keeping the prediction for the noise's tokens only. On our loop each row does the same:
its texts are its own request's (prompt and upload: `text_reads_image`), its conditioning the
upload's latents (`condition`, the VAE's mode: no random numbers), kept unpacked beside the
noise's and packed after them each forward (`predict_conditioned`). Rows of one upload size and
output size share a forward (the batching key holds both: the sequence's length), their texts at
their own lengths (masks, text buckets). What Qwen-Image's adapter knows - the guidance, the
latents' packing and schedule, the decode - holds here unchanged. The pipeline's own call stays
for what our loop does not run (CFG-parallel ranks): one single-image call a row.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from vllm_omni_like.models.packing import pack, unpack
from vllm_omni_like.models.qwen_image import EDIT_FAMILY
from vllm_omni_like.models.qwen_image.adapter import (
    NO_NEGATIVE,
    QwenImageAdapter,
)
from vllm_omni_like.models.qwen_image.vl_processor import VisionTextProcessor
from vllm_omni_like.models.row_conditions import Conditioning
from vllm_omni_like.models.text_buckets import TEXT_BUCKETS, bucket_prompts, pad_tokens, text_bucket
from vllm_omni_like.wire import Mode

FITTED_AREA = 1024 * 1024  # the pixels QwenImageEditPipeline fits an upload to
# An edit's text holds the upload's vision tokens (about 1,370 at a megapixel) beside its prompt,
# and the pipeline cuts none of it (its `max_sequence_length` is only checked, <= 1024, never
# applied to an edit's text): buckets past Qwen-Image's 512, so a real upload's texts share a
# few shapes (one a prompt length would compile at run time on a compiled stage).
EDIT_TEXT_BUCKETS = (*TEXT_BUCKETS, 1024, 1536, 2048)


class QwenImageEditAdapter(QwenImageAdapter):
    family = EDIT_FAMILY
    image_conditions = ("edit",)
    conditioned = True
    text_reads_image = True

    def encode_text_with_images(
        self, texts: list[str | None], images: list[Any], device: torch.device
    ) -> Any:
        """Each text read with its row's upload, fitted as the pipeline's single-image call
        fits it (a negative prompt not given: Qwen-Image's); padded to its text bucket."""
        embeds, mask = self.pipe.encode_prompt(
            prompt=[NO_NEGATIVE if t is None else t for t in texts],
            image=[fit_upload(self.pipe, image)[0] for image in images],
            device=device,
            num_images_per_prompt=1,
        )
        if mask is None:  # (every token is a prompt's: the pipeline leaves the mask out)
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return pad_tokens({"embeds": embeds, "mask": mask}, edit_text_bucket(embeds.shape[1]))

    def condition(
        self, image: Any, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> Conditioning:
        """The upload's latents as the pipeline's `prepare_latents` makes them (fitted,
        preprocessed, the VAE's mode, normalized by its statistics), unpacked."""
        pipe = self.pipe
        fitted, width, height = fit_upload(pipe, image)
        pixels = pipe.image_processor.preprocess(fitted, height, width).unsqueeze(2)
        channels = pipe.transformer.config.in_channels // 4
        placeholder = torch.empty(0, device=device, dtype=dtype)  # (no noise drawn: the loop's)
        _, tokens = pipe.prepare_latents(
            pixels, 1, channels, height, width, dtype, device, None, placeholder
        )
        factor = pipe.vae_scale_factor
        return {"image": unpack(tokens, height // factor, width // factor)}

    def predict_conditioned(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text: Any,
        conditioning: Conditioning,
        at: Any = None,
    ) -> Any:
        """The noise's tokens, then the upload's, in one sequence; the prediction for the
        noise's."""
        rows, _, h, w = latents.shape
        image = conditioning["image"]
        tokens = pack(latents)
        shapes = [(1, h // 2, w // 2), (1, image.shape[-2] // 2, image.shape[-1] // 2)]
        out = self.pipe.transformer(
            hidden_states=torch.cat([tokens, pack(image)], dim=1),
            timestep=timestep.to(latents.dtype) / 1000,
            guidance=None,
            encoder_hidden_states_mask=text["mask"],
            encoder_hidden_states=text["embeds"],
            img_shapes=[shapes] * rows,
            return_dict=False,
        )[0]
        return unpack(out[:, : tokens.shape[1]], h, w)

    def warm_up_prompts(self, device: torch.device) -> tuple[str, ...]:
        """One a text bucket a prompt reaches, its tokens counted with a blank upload's vision
        tokens (a real model's, about 1,370 at a megapixel, reach only the buckets past 1024;
        a text past the last bucket runs at its own length: one prompt then)."""
        from PIL import Image

        blank = Image.new("RGB", (1024, 1024))

        def count(prompt: str) -> int:
            return int(self.encode_text_with_images([prompt], [blank], device)["mask"].sum())

        if count("warm-up") > EDIT_TEXT_BUCKETS[-1]:
            return ("warm-up",)
        return bucket_prompts(count, EDIT_TEXT_BUCKETS) or ("warm-up",)

    @classmethod
    def own_components(cls, path: str) -> dict[str, Any]:
        """The processor loads here (models/qwen_image/vl_processor.py says why)."""
        return {"processor": VisionTextProcessor.load(os.path.join(path, "processor"))}

    def edit_pipelines(self, stage: str) -> dict[str, Any]:
        """The model itself (it only edits), for the pipeline's call: each row's image fitted
        as its single-image call fits one, its texts padded to text buckets."""
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
        text = pad_tokens({"embeds": embeds, "mask": mask}, edit_text_bucket(embeds.shape[1]))
        return text["embeds"], text["mask"]

    pipe.encode_prompt = encode_prompt
    pipe._text_buckets = True


def edit_text_bucket(tokens: int) -> int:
    """The bucket an edit's text of `tokens` tokens (its prompt and upload) is padded to."""
    return text_bucket(tokens, EDIT_TEXT_BUCKETS)


def fit_upload(pipe: Any, image: Any) -> tuple[Any, int, int]:
    """An upload (a PIL image) as QwenImageEditPipeline fits it, and its fitted width and
    height: about a megapixel at its aspect, in multiples of 32 (`calculate_dimensions`),
    resized by the pipeline's image processor."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    width, height, _ = calculate_dimensions(FITTED_AREA, image.width / image.height)
    return pipe.image_processor.resize(image, height, width), width, height


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
