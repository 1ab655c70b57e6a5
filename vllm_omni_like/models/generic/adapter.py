"""Any other diffusers pipeline in a worker: its own `__call__` decodes, its guidance runs as
the pipeline does it, no streamed encode. What a UNet pipeline gains from layout and compiling
(the UNet and an image VAE's decoder), it gets; CFG-parallel splits a UNet's doubled batch."""

from __future__ import annotations

from typing import Any

from vllm_omni_like.models.adapter import (
    Adapter,
    Guidance,
    fuse_unet_qkv,
    nhwc_unet_and_image_vae,
    split_unet_batch,
    unet_compile_targets,
)
from vllm_omni_like.parallel.cfg_parallel import Leader, PairCFG, SplitCFG


class GenericAdapter(Adapter):
    guidance = Guidance.NONE  # not known here: the pipeline's call applies its own

    def load_warning(self) -> str | None:
        from vllm_omni_like.models.registry import FAMILIES

        return (
            f"{type(self.pipe).__name__} has no family adapter here: it runs through the "
            "pipeline's own call, whole requests batched together, without the decode overlap, "
            f"CFG batching or streamed MP4 of the families ({', '.join(f.name for f in FAMILIES)})"
        )

    def fuse_qkv(self) -> bool:
        return fuse_unet_qkv(self.pipe)

    def channels_last(self, compiled: bool, forced: bool) -> bool:
        return nhwc_unet_and_image_vae(self.pipe, compiled, forced)

    def compile_targets(self) -> list[tuple[Any, str]]:
        if self.denoiser_name == "unet":
            return unet_compile_targets(self.pipe)
        return super().compile_targets()

    def text_encoder_targets(self) -> list[tuple[Any, str]]:
        """None: the pipeline's own call encodes a whole batch's prompts, a shape a batch."""
        return []

    def split_cfg(self, leader: Leader) -> SplitCFG | PairCFG:
        if self.denoiser_name != "unet":
            return super().split_cfg(leader)
        return split_unet_batch(self.pipe, leader)


ADAPTER = GenericAdapter
