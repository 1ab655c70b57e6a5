"""Wan2.2-TI2V in a worker: text to video and video from a first frame, both on our own loop
and in one forward. WanImageToVideoPipeline over the same models (`expand_timesteps`) makes a
video from a frame by putting the frame's latents in place of the first latent frame's - in
each forward's input, its tokens at timestep 0, and in the result; each row here carries that
frame's latents and its frame mask (`condition`: the pipeline's `prepare_latents`), the frame put
back on joining and after every step (`put_back`: where the mask keeps the latents they are
the same values, so each forward sees what the pipeline's does, and the scheduler's update is
elementwise), each token's timestep the row's times its mask (`model_inputs`). A row from text
carries the all-ones mask: nothing put back, every token at its row's timestep, as WanPipeline
runs it; so rows from text and from a frame share a shape group and a forward."""

from __future__ import annotations

import functools
from typing import Any

import torch

from vllm_omni_like.models.row_conditions import Conditioning
from vllm_omni_like.models.wan import TI2V_FAMILY
from vllm_omni_like.models.wan.adapter import WanAdapter
from vllm_omni_like.wire import Mode


class WanTI2VAdapter(WanAdapter):
    family = TI2V_FAMILY
    image_conditions = ("image",)
    conditioned = True  # (rows from text too: they share the forward of rows from a frame)

    @functools.cached_property
    def image_pipeline(self) -> Any:
        """WanImageToVideoPipeline over this pipeline's models (no image encoder among them)."""
        from diffusers import WanImageToVideoPipeline

        pipe = WanImageToVideoPipeline(
            **self.pipe.components,
            boundary_ratio=self.pipe.config.get("boundary_ratio"),
            expand_timesteps=True,
        )
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def edit_pipelines(self, stage: str) -> dict[str, Any]:
        return {Mode.IMAGE2VIDEO: self.image_pipeline}  # (for the pipeline's call)

    def condition(
        self, image: Any, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> Conditioning:
        """The frame's latents and the frame mask (0 on the first latent frame) as the image
        pipeline's `prepare_latents` makes them for latents of `shape`; a row from text: the
        all-ones mask (and zeros for a frame)."""
        _, channels, frames, h, w = shape
        if image is None:
            return {
                "first": torch.zeros((1, channels, 1, h, w), dtype=dtype, device=device),
                "mask": torch.ones((1, 1, frames, h, w), dtype=dtype, device=device),
            }
        pipe = self.image_pipeline
        height, width = h * pipe.vae_scale_factor_spatial, w * pipe.vae_scale_factor_spatial
        num_frames = (frames - 1) * pipe.vae_scale_factor_temporal + 1
        pixels = pipe.video_processor.preprocess(image, height=height, width=width)
        pixels = pixels.to(device, dtype=torch.float32)
        placeholder = torch.empty(0, device=device, dtype=dtype)  # (no noise drawn: the loop's)
        _, first, mask = pipe.prepare_latents(
            pixels, 1, channels, height, width, num_frames, dtype, device, None, placeholder
        )
        return {"first": first, "mask": mask}

    def put_back(self, latents: torch.Tensor, conditioning: Conditioning) -> torch.Tensor:
        """The pipeline's `(1 - mask) * condition + mask * latents`, row by row."""
        mask = conditioning["mask"]
        return (1 - mask) * conditioning["first"] + mask * latents

    def model_inputs(
        self,
        model: Any,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        conditioning: Conditioning | None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """Each latent token's timestep: its row's times its mask at the token's patch (0 on
        the first frame of a row from a frame)."""
        if conditioning is None:
            return super().model_inputs(model, latents, timestep, conditioning)
        p = model.config.patch_size
        mask = conditioning["mask"][:, 0, :: p[0], :: p[1], :: p[2]]
        return latents, (mask * timestep.reshape(-1, 1, 1, 1)).flatten(1), {}


ADAPTER = WanTI2VAdapter
