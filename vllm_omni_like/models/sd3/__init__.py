"""The Stable Diffusion 3 family (SD3.5-medium, SD3.5-large and their architectures
`sd3.5-medium`, `sd3.5-large`): torch-free description; the adapter is models/sd3/adapter.py.

A rectified-flow MMDiT over 2x2 patches with classifier-free guidance (the pipeline doubles its
batch: one forward a step), conditioned on two CLIPs' penultimate states beside T5's tokens and
their pooled embeddings. The text length is fixed (77 CLIP + `max_sequence_length` T5 tokens).
"""

from vllm_omni_like.models.family import Family
from vllm_omni_like.wire import Mode

FAMILY = Family(
    name="stable-diffusion-3",
    pipelines=(
        "StableDiffusion3Pipeline",
        "StableDiffusion3Img2ImgPipeline",
        "StableDiffusion3InpaintPipeline",
    ),
    output="image",
    size_base=16,  # StableDiffusion3Pipeline.check_inputs: the VAE's factor x the patch
    default_guidance=7.0,  # StableDiffusion3Pipeline's
    adapter="vllm_omni_like.models.sd3.adapter",
    fp8=True,
    step_cache=True,
    own_loop=(Mode.TEXT2IMG, Mode.EDIT, Mode.INPAINT),
    inpaints=True,
    schedulers=("flow-euler",),
    # at their published defaults (1024x1024 from their VAE's config)
    presets={
        "sd3.5-medium": {"default_steps": 40, "default_guidance": 4.5},
        "sd3.5-large": {"default_steps": 28, "default_guidance": 3.5},
    },
)
