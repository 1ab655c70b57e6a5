"""Wan2.2-TI2V in a worker: text to video as the Wan family runs it (our loop, a timestep per
latent token); image to video through WanImageToVideoPipeline's call over the same models - the
first frame's latents in place of the noise's, that frame at timestep 0 - one request a call."""

from __future__ import annotations

from typing import Any

from vllm_omni_like.models.wan import TI2V_FAMILY
from vllm_omni_like.models.wan.adapter import WanAdapter
from vllm_omni_like.wire import Mode


class WanTI2VAdapter(WanAdapter):
    family = TI2V_FAMILY
    image_conditions = ("image",)

    def edit_pipelines(self, stage: str) -> dict[str, Any]:
        from diffusers import WanImageToVideoPipeline

        pipe = WanImageToVideoPipeline(
            **self.pipe.components,  # (WanPipeline's models: no image encoder among them)
            boundary_ratio=self.pipe.config.get("boundary_ratio"),
            expand_timesteps=True,
        )
        pipe.set_progress_bar_config(disable=True)
        return {Mode.IMAGE2VIDEO: pipe}

    def warm_up_modes(self) -> tuple[Mode, ...]:
        return (Mode.IMAGE2VIDEO,)  # the first frame's latents at timestep 0 beside the noise


ADAPTER = WanTI2VAdapter
