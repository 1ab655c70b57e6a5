"""Any other diffusers pipeline in a worker: its own `__call__` decodes, its guidance runs as
the pipeline does it, no streamed encode. What a UNet pipeline gains from layout and compiling
(the UNet and an image VAE's decoder), it gets; CFG-parallel splits a UNet's doubled batch."""

from __future__ import annotations

from typing import Any

from vllm_omni_like.models.adapter import (
    Adapter,
    Guidance,
    nhwc_unet_and_image_vae,
    unet_adapter_speed,
)
from vllm_omni_like.parallel.cfg_parallel import Leader, PairCFG, SplitCFG


class GenericAdapter(Adapter):
    guidance = Guidance.NONE  # not known here: the pipeline's call applies its own

    def fuse_qkv(self) -> bool:
        if getattr(self.pipe, "unet", None) is None or not hasattr(
            self.pipe, "fuse_qkv_projections"
        ):
            return False
        self.pipe.fuse_qkv_projections()
        return True

    def channels_last(self, compiled: bool, forced: bool) -> bool:
        return nhwc_unet_and_image_vae(self.pipe, compiled, forced)

    def compile_targets(self) -> list[tuple[Any, str]]:
        if self.denoiser_name == "unet":
            return unet_adapter_speed(self.pipe)
        return super().compile_targets()

    def split_cfg(self, leader: Leader) -> SplitCFG | PairCFG:
        if self.denoiser_name != "unet":
            return super().split_cfg(leader)
        wrapper = SplitCFG(self.pipe.unet, leader)  # a UNet pipeline doubles its batch
        self.pipe.unet = wrapper
        return wrapper


ADAPTER = GenericAdapter
