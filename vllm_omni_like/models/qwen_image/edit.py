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

from vllm_omni_like.models.qwen_image import EDIT_FAMILY
from vllm_omni_like.models.qwen_image.adapter import QwenImageAdapter
from vllm_omni_like.models.qwen_image.vl_processor import VisionTextProcessor


class QwenImageEditAdapter(QwenImageAdapter):
    family = EDIT_FAMILY
    image_conditions = ("edit",)

    @classmethod
    def own_components(cls, path: str) -> dict[str, Any]:
        """The processor loads here (models/qwen_image/vl_processor.py says why)."""
        return {"processor": VisionTextProcessor.load(os.path.join(path, "processor"))}

    def edit_pipelines(self, stage: str) -> dict[str, Any]:
        return {"edit": self.pipe}  # (the model itself: it only edits)


ADAPTER = QwenImageEditAdapter
