"""Image edits (img2img, inpaint): a batch's images and masks as the edit pipelines (which the
family's adapter makes from the text-to-image one) take them; an image-to-video request's first
frame."""

from __future__ import annotations

from typing import Any

from vllm_omni_like.params import DEFAULT_STRENGTH as STRENGTH
from vllm_omni_like.wire import Mode, StageRequest


def edit_inputs(
    batch: list[StageRequest],
    kwargs: dict[str, Any],
    pad: int,
    size_multiple: int,
    strength: bool = True,
) -> str:
    """Put the batch's images (and masks) into `kwargs`; returns the `edit_pipes` key of the
    pipeline that takes them: `Mode.EDIT` (img2img, or an edit by instruction) or "inpaint".

    Sizes default to the first image's, rounded down to `size_multiple`; `pad` filler rows
    (a compiled stage's bucket padding) repeat the last image. `strength`: the pipeline takes
    one (img2img: the image, resized to the output, is where the steps start); else it edits
    by instruction: the image goes as uploaded (one size a batch: the batching key), for the
    pipeline to fit by its model's rules.
    """
    from PIL import Image

    images, masks = [], []
    first = batch[0]
    width, height = edit_size(first, size_multiple)
    kwargs.update(height=height, width=width)
    for r in batch:
        image = Image.fromarray(r.images[0]).convert("RGB")
        if strength:
            image = image.resize((width, height))
        for _ in range(r.params.n):
            images.append(image)
            if r.mask is not None:
                masks.append(Image.fromarray(r.mask).convert("L").resize((width, height)))
    images += images[-1:] * pad
    masks += masks[-1:] * pad
    kwargs["image"] = images
    if not strength:
        return Mode.EDIT
    kwargs["strength"] = first.params.strength if first.params.strength is not None else STRENGTH
    # diffusers runs int(steps x strength) steps and fails on none: run one at least (the API
    # already asks for enough steps; this covers the Python API)
    while int(kwargs["num_inference_steps"] * kwargs["strength"]) < 1:
        kwargs["num_inference_steps"] += 1
    if masks:
        kwargs["mask_image"] = masks
        return "inpaint"
    return Mode.EDIT


def edit_size(request: StageRequest, size_multiple: int) -> tuple[int, int]:
    """An edit's output size: the one it gives, else its upload's rounded down to the model's
    multiple."""
    m, p, shape = size_multiple, request.params, request.images[0].shape
    return p.width or max(m, shape[1] // m * m), p.height or max(m, shape[0] // m * m)


def source_pixels(request: StageRequest, processor: Any, width: int, height: int) -> Any:
    """An image-to-image row's source as its pipeline's call takes it: the upload resized to
    the output (as `edit_inputs` hands it over), then the pipeline's `image_processor`
    (1, 3, H, W in [-1, 1], float32, on the host)."""
    from PIL import Image

    image = Image.fromarray(request.images[0]).convert("RGB").resize((width, height))
    return processor.preprocess(image, height=height, width=width)


def mask_pixels(request: StageRequest, processor: Any, width: int, height: int) -> Any:
    """An inpainting row's mask as its pipeline's call takes it: resized to the output (as
    `edit_inputs` hands it over), then the pipeline's `mask_processor` (1, 1, H, W in [0, 1])."""
    from PIL import Image

    assert request.mask is not None, "an inpainting row without a mask"
    mask = Image.fromarray(request.mask).convert("L").resize((width, height))
    return processor.preprocess(mask, height=height, width=width)


def upload_image(request: StageRequest) -> Any:
    """An edit's upload as an RGB PIL image, as sent (an instruction edit's pipeline fits it
    by its own rules)."""
    from PIL import Image

    return Image.fromarray(request.images[0]).convert("RGB")


def first_frame(request: StageRequest, width: int, height: int) -> Any:
    """An image-to-video request's image as its video's first frame: scaled (aspect kept) to
    cover WxH, then its centre cut out - never stretched."""
    from PIL import Image

    image = Image.fromarray(request.images[0]).convert("RGB")
    scale = max(width / image.width, height / image.height)
    w = max(width, round(image.width * scale))
    h = max(height, round(image.height * scale))
    if (w, h) != image.size:
        image = image.resize((w, h), Image.Resampling.LANCZOS)
    left, top = (w - width) // 2, (h - height) // 2
    return image.crop((left, top, left + width, top + height))
