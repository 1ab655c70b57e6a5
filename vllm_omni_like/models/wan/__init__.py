"""The Wan video family (Wan2.1 T2V and its architecture, the embedded tiny-video model):
torch-free description; the adapter is models/wan/adapter.py."""

from __future__ import annotations

from vllm_omni_like.models.family import Config, Family


def wan_vae_factors(vae: Config) -> tuple[int, int | None]:
    """AutoencoderKLWan says its factors (8 and 4 in Wan2.1's)."""
    return int(vae["scale_factor_spatial"]), int(vae["scale_factor_temporal"])


FAMILY = Family(
    name="wan",
    pipelines=("WanPipeline",),
    output="video",
    size_base=16,  # WanPipeline.check_inputs
    default_guidance=5.0,
    adapter="vllm_omni_like.models.wan.adapter",
    vae_factors=wan_vae_factors,
    own_loop=("text2video",),
    schedulers=("unipc", "flow-euler"),
)
