"""From validated schemas to engine requests, and from outputs to response items."""

from __future__ import annotations

import base64
from dataclasses import replace
from typing import Any

from vllm_omni_like.config import Limits
from vllm_omni_like.engine import AsyncOmni
from vllm_omni_like.errors import InvalidRequestError, NotFoundError
from vllm_omni_like.inputs import OmniRequest
from vllm_omni_like.media import encode_image
from vllm_omni_like.outputs import OmniRequestOutput
from vllm_omni_like.protocol.admission import (
    edit_params,
    image_inputs,
    image_params,
    video_params,
)
from vllm_omni_like.protocol.loras import lora_refs, split_model
from vllm_omni_like.protocol.schemas import ImageRequest, VideoRequest


def pick_pipeline(engine: AsyncOmni, model: str | None, output: str) -> str:
    """The named pipeline, or the first served one that makes `output` (image or video)."""
    names = engine.pipeline_names
    if model:
        if model not in names:
            raise NotFoundError(
                f"model {model!r} is not served here; served: {', '.join(names)}",
                param="model",
                code="model_not_found",
            )
        if engine.pipeline_output(model) != output:
            raise InvalidRequestError(
                f"model {model!r} makes {engine.pipeline_output(model)}s, not {output}s",
                param="model",
            )
        return model
    for name in names:
        if engine.pipeline_output(name) == output:
            return name
    raise NotFoundError(f"no served model makes {output}s", param="model", code="model_not_found")


def image_request(
    engine: AsyncOmni,
    body: ImageRequest,
    limits: Limits,
    request_id: str,
    images: list[Any] | None = None,
    mask: Any | None = None,
    timeout: float | None = None,
    client_id: str | None = None,
    stores_output: bool = False,
) -> OmniRequest:
    named, adapter = split_model(engine, body.model)
    pipeline = pick_pipeline(engine, named, "image")
    model = engine.model_limits(pipeline)
    image_inputs(model, pipeline, bool(images), mask is not None)
    if images:
        params = edit_params(body, limits, model, pipeline, images[0].shape[1::-1])
    else:
        params = image_params(body, limits, model, pipeline)
    params = replace(params, loras=lora_refs(engine, pipeline, body.lora, adapter))
    return OmniRequest(
        request_id,
        body.prompt,
        pipeline,
        params,
        images=images or [],
        mask=mask,
        timeout=timeout,
        client_id=client_id,
        stores_output=stores_output,
        encodes_png=body.output_format == "png",
    )


def video_request(
    engine: AsyncOmni,
    body: VideoRequest,
    limits: Limits,
    request_id: str,
    images: list[Any] | None = None,
    timeout: float | None = None,
) -> OmniRequest:
    named, adapter = split_model(engine, body.model)
    pipeline = pick_pipeline(engine, named, "video")
    upload = images[0].shape[1::-1] if images else None  # (width, height)
    params = video_params(body, limits, engine.model_limits(pipeline), pipeline, upload)
    return OmniRequest(
        request_id,
        body.prompt,
        pipeline,
        replace(params, loras=lora_refs(engine, pipeline, body.lora, adapter)),
        images=images or [],
        timeout=timeout,
        stores_output=True,  # the video job writes the file; it counts the request
        files_only=True,  # the MP4 and the thumbnail: its frames stay in the worker
    )


def image_items(
    output: OmniRequestOutput, fmt: str, compression: int | None, as_b64: bool = True
) -> list[dict[str, Any]]:
    """Encode each image (CPU work: call it in a thread); under 'b64_json' its base64 (ASCII
    bytes: api/serving.images_json splices them in as they are), or raw bytes under 'bytes'."""
    items = []
    for image in output.result.images:
        data = encode_image(image.pixels, fmt, compression, image.scanlines)
        item: dict[str, Any] = {"seed": image.seed}
        if as_b64:
            item["b64_json"] = base64.b64encode(data)
        else:
            item["bytes"] = data
        if output.revised_prompt is not None:
            item["revised_prompt"] = output.revised_prompt
        items.append(item)
    return items
