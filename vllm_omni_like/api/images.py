"""POST /v1/images/generations (JSON) and /v1/images/edits (multipart)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from vllm_omni_like.api.serving import (
    SSE_HEADERS,
    Server,
    image_response,
    run_to_outputs,
    stream_images,
)
from vllm_omni_like.errors import InvalidRequestError
from vllm_omni_like.media import decode_mask, decode_upload, upload_too_large
from vllm_omni_like.protocol.requests import image_request
from vllm_omni_like.protocol.schemas import ImageRequest

router = APIRouter()


def _server(request: Request) -> Server:
    return request.app.state.server


async def _respond(
    request: Request,
    body: ImageRequest,
    images: list[Any] | None = None,
    mask: Any | None = None,
    prefix: str = "image_generation",
):
    server = _server(request)
    state = request.state
    omni = image_request(
        server.engine,
        body,
        server.settings.limits,
        state.engine_request_id,
        images,
        mask,
        client_id=state.request_id,
        stores_output=body.response_format == "url" and not body.stream,
    )
    if body.stream:
        stream = server.open(request, omni)  # admission errors still get their real status
        return StreamingResponse(
            stream_images(server, stream, body, prefix, request.state.request_id),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    (output,) = await run_to_outputs(request, server, [omni])
    write = asyncio.to_thread(image_response, server, output, body, str(request.base_url), omni)
    content = await server.engine.store(omni, write, "image")
    return Response(content, media_type="application/json")


@router.post("/v1/images/generations")
async def generations(request: Request, body: ImageRequest):
    return await _respond(request, body)


def validated(model: type, fields: dict[str, Any]):
    """Build a schema from form fields; pydantic errors become a 400 naming the field."""
    try:
        return model(**fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) or None
        raise InvalidRequestError(f"{param}: {err['msg']}", param=param) from None


async def read_upload(server: Server, upload: Any, param: str, decode=decode_upload):
    if not isinstance(upload, UploadFile):
        raise InvalidRequestError(
            f"{param} must be a file upload", param=param, code="invalid_image"
        )
    limits = server.settings.limits
    if upload.size is not None and upload.size > limits.max_upload_bytes:
        raise upload_too_large(param, limits.max_upload_bytes, upload.size)
    data = await upload.read(limits.max_upload_bytes + 1)  # over it: "over the limit"
    return await asyncio.to_thread(
        decode, data, limits.max_upload_bytes, limits.max_upload_pixels, param
    )


async def _complete_multipart(request: Request) -> None:
    """A multipart body cut short (no closing boundary) is named as such: the parser would
    drop its unfinished part and the route would report a missing field instead."""
    found = re.search(r'boundary="?([^";]+)"?', request.headers.get("content-type", ""))
    if found is None:
        return  # not multipart: the form parser says what is wrong
    body = await request.body()  # kept by the request: the form parser reads it from there
    if not body.rstrip(b"\r\n").endswith(b"--" + found.group(1).encode("latin-1") + b"--"):
        raise InvalidRequestError(
            f"the multipart body is truncated: its {len(body)} bytes end before the closing "
            "boundary",
            code="invalid_multipart",
        )


@router.post("/v1/images/edits")
async def edits(request: Request):
    server = _server(request)
    await _complete_multipart(request)
    form = await request.form(max_files=16, max_fields=64)
    try:
        uploads = form.getlist("image") + form.getlist("image[]")
        if not uploads:
            raise InvalidRequestError("an image file is required (image or image[])", param="image")
        fields = {
            k: v
            for k, v in form.multi_items()
            if k not in ("image", "image[]", "mask") and isinstance(v, str)
        }
        body = validated(ImageRequest, fields)
        images = [await read_upload(server, u, "image") for u in uploads]
        mask = None
        if form.get("mask") is not None:
            mask = await read_upload(server, form.get("mask"), "mask", decode_mask)
            if mask.shape[:2] != images[0].shape[:2]:
                raise InvalidRequestError(
                    "mask must have the same size as the image", param="mask", code="invalid_image"
                )
    finally:
        await form.close()
    return await _respond(request, body, images, mask, prefix="image_edit")
