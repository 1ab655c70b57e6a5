"""Qwen2.5-VL's processor for a text and its images, as Qwen-Image-Edit's pipeline calls it.

transformers' Qwen2VLProcessor also holds a video processor, which cannot be made without
torchvision (not installed with the CPU build of torch this project takes), so the pipeline's
`processor` folder loads here instead: the same image processor (Qwen2VLImageProcessor: the
image resized to whole 28-pixel patches within its pixel limits, normalized, cut into patches)
and tokenizer, and the same expansion of each `<|image_pad|>` into one token per merged patch
of its image, in order.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import ProcessorMixin

IMAGE_TOKEN = "<|image_pad|>"


class VisionTextProcessor(ProcessorMixin):  # type: ignore[misc]  # diffusers checks the class
    def __init__(self, image_processor: Any, tokenizer: Any) -> None:  # (not ProcessorMixin's)
        self.image_processor = image_processor
        self.tokenizer = tokenizer
        self.merge = int(image_processor.merge_size)

    @classmethod
    def load(cls, folder: str) -> VisionTextProcessor:
        from transformers import AutoTokenizer, Qwen2VLImageProcessor

        return cls(
            Qwen2VLImageProcessor.from_pretrained(folder, local_files_only=True),
            AutoTokenizer.from_pretrained(folder, local_files_only=True),
        )

    def __repr__(self) -> str:
        return f"VisionTextProcessor({type(self.image_processor).__name__})"

    def save_pretrained(self, folder: str, *args: Any, **kwargs: Any) -> None:
        os.makedirs(folder, exist_ok=True)
        self.image_processor.save_pretrained(folder)
        self.tokenizer.save_pretrained(folder)

    def __call__(
        self,
        text: str | list[str],
        images: Any = None,
        padding: bool = True,
        return_tensors: str = "pt",
    ) -> Any:
        from transformers import BatchFeature

        texts = [text] if isinstance(text, str) else list(text)
        data: dict[str, Any] = {}
        if images is not None:
            vision = self.image_processor(images=images, return_tensors=return_tensors)
            counts = [int(grid.prod()) // self.merge**2 for grid in vision["image_grid_thw"]]
            texts = expand_image_tokens(texts, counts)
            data.update(vision)
        data.update(self.tokenizer(texts, padding=padding, return_tensors=return_tensors))
        return BatchFeature(data=data)


def expand_image_tokens(texts: list[str], counts: list[int]) -> list[str]:
    """Each `<|image_pad|>`, in order over the texts, repeated once per merged patch of the
    image it stands for (`counts`)."""
    left = iter(counts)
    out = []
    for text in texts:
        pieces = text.split(IMAGE_TOKEN)
        try:
            pads = [IMAGE_TOKEN * next(left) for _ in pieces[1:]]
        except StopIteration:
            raise ValueError(f"more {IMAGE_TOKEN} in the texts than images") from None
        out.append(pieces[0] + "".join(p + rest for p, rest in zip(pads, pieces[1:], strict=True)))
    if next(left, None) is not None:
        raise ValueError(f"more images than {IMAGE_TOKEN} in the texts")
    return out
