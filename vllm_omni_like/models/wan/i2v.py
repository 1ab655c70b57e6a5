"""Wan image to video in a worker (WanImageToVideoPipeline: Wan2.1-I2V with its CLIP image
encoder, Wan2.2-I2V-A14B's two experts): the pipeline's own call, one request a call (it encodes
one image), its first frame's latents and mask beside the noise in each step's input. What the
Wan adapter knows - experts, text, decode, the chunked MP4 - holds unchanged."""

from __future__ import annotations

from typing import Any

from vllm_omni_like.models.wan import I2V_FAMILY
from vllm_omni_like.models.wan.adapter import WanAdapter
from vllm_omni_like.wire import Mode


class WanI2VAdapter(WanAdapter):
    family = I2V_FAMILY
    image_conditions = ("image",)
    branch_inputs = ("encoder_hidden_states_image",)  # (Wan2.1-I2V's CLIP features)

    def edit_pipelines(self, stage: str) -> dict[str, Any]:
        return {Mode.IMAGE2VIDEO: self.pipe}  # (the model itself: it only starts from an image)


ADAPTER = WanI2VAdapter
