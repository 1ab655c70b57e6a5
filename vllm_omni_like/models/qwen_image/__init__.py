"""The Qwen-Image family (Qwen-Image and its architecture `qwen-image`): torch-free
description; the adapter is models/qwen_image/adapter.py.

A 60-block MMDiT over 2x2-packed latent tokens of a causal video VAE run on one frame, its text
from Qwen2.5-VL's last hidden states under a chat template whose system prompt is cut off:
prompts keep their own token counts (padded within a batch, with a mask). True classifier-free
guidance: the negative prompt runs its own forward at its own length, and the guided velocity
is rescaled to the conditional one's norm per token. Its img2img and inpainting edits
(QwenImageImg2ImgPipeline, QwenImageInpaintPipeline) run on our own loop too.

Qwen-Image-Edit (`EDIT_FAMILY`, its architecture `qwen-image-edit`): the same transformer and
VAE; it edits an input image by instruction (no strength), on our own loop: Qwen2.5-VL reads the
prompt with the image, and the image's latents join the noise's tokens at every step. It makes
no image from text alone.
"""

from vllm_omni_like.models.family import Config, Family
from vllm_omni_like.wire import Mode


def qwen_vae_factors(vae: Config) -> tuple[int, int | None]:
    """AutoencoderKLQwenImage halves the image once per `temperal_downsample` entry."""
    return 2 ** len(vae.get("temperal_downsample", [False, True, True])), None


FAMILY = Family(
    name="qwen-image",
    pipelines=("QwenImagePipeline", "QwenImageImg2ImgPipeline", "QwenImageInpaintPipeline"),
    output="image",
    size_base=16,  # QwenImagePipeline.check_inputs: the VAE's factor x the 2x2 packing
    default_guidance=4.0,  # the true CFG scale Qwen-Image is shown with
    adapter="vllm_omni_like.models.qwen_image.adapter",
    fp8=True,
    fp8_attention=True,
    step_cache=True,
    vae_factors=qwen_vae_factors,
    own_loop=(Mode.TEXT2IMG, Mode.EDIT, Mode.INPAINT),
    inpaints=True,
    schedulers=("flow-euler",),
    native_side=1024,  # QwenImagePipeline.default_sample_size (128) x the VAE's factor
    presets={"qwen-image": {"default_steps": 50}},  # its published defaults
)


EDIT_FAMILY = Family(
    name="qwen-image-edit",
    pipelines=("QwenImageEditPipeline",),
    output="image",
    size_base=16,
    default_guidance=4.0,  # the true CFG scale Qwen-Image-Edit is shown with
    adapter="vllm_omni_like.models.qwen_image.edit",
    fp8=True,
    fp8_attention=True,
    vae_factors=qwen_vae_factors,
    own_loop=(Mode.EDIT,),
    schedulers=("flow-euler",),
    native_side=1024,
    needs_image=True,
    edit_strength=False,
    presets={"qwen-image-edit": {"default_steps": 50}},
)
