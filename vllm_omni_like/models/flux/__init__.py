"""The FLUX.1 family (FLUX.1-dev, FLUX.1-schnell and their architectures `flux.1-dev`,
`flux.1-schnell`): torch-free description; the adapter is models/flux/adapter.py.

A rectified-flow MMDiT over 2x2-packed latent tokens, conditioned on T5 text tokens and a CLIP
pooled embedding; FLUX.1-dev's guidance is distilled into an embedding (one forward a step, no
negative branch), FLUX.1-schnell has none (4 steps). The text length is fixed (T5 padded to
`max_sequence_length`), so rows batch without masks.
"""

from vllm_omni_like.models.family import Family
from vllm_omni_like.wire import Mode

FAMILY = Family(
    name="flux",
    pipelines=("FluxPipeline", "FluxImg2ImgPipeline", "FluxInpaintPipeline"),
    output="image",
    size_base=16,  # FluxPipeline.check_inputs: the VAE's factor x the 2x2 packing
    default_guidance=3.5,  # FluxPipeline's
    adapter="vllm_omni_like.models.flux.adapter",
    fp8=True,
    fp8_attention=True,
    step_cache=True,
    own_loop=(Mode.TEXT2IMG, Mode.EDIT, Mode.INPAINT),
    inpaints=True,
    schedulers=("flow-euler",),
    # at their published defaults (1024x1024 from their VAE's config); schnell: no guidance
    presets={
        "flux.1-dev": {"default_steps": 28},
        "flux.1-schnell": {"default_steps": 4, "default_guidance": 0.0},
    },
)
