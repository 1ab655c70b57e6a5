"""/v1/videos: create (multipart or JSON; `input_reference`, a first frame, as a multipart file),
list, retrieve, delete, content."""

from __future__ import annotations

import asyncio
from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from vllm_omni_like.api.errors import error_response
from vllm_omni_like.api.images import read_upload, validated
from vllm_omni_like.api.video_jobs import POLL_AFTER_MS, VideoService, video_object
from vllm_omni_like.errors import (
    ConflictError,
    ErrorInfo,
    ErrorKind,
    InvalidRequestError,
    NotFoundError,
)
from vllm_omni_like.protocol.schemas import VideoRequest

router = APIRouter()


def _service(request: Request) -> VideoService:
    return request.app.state.server.videos


def _object_response(row: dict, status: int = 200) -> JSONResponse:
    headers = {}
    if row["status"] in ("queued", "in_progress"):
        headers["openai-poll-after-ms"] = str(POLL_AFTER_MS)
    return JSONResponse(video_object(row), status_code=status, headers=headers)


async def _row(request: Request, video_id: str) -> dict:
    row = await _service(request).get(video_id)
    if row is None:
        raise NotFoundError(f"no video {video_id!r}", code="video_not_found", param="video_id")
    return row


@router.post("/v1/videos")
async def create(request: Request) -> JSONResponse:
    server = request.app.state.server
    server.ensure_ready()
    ctype = request.headers.get("content-type", "")
    image = None  # input_reference: HxWx3 uint8
    if ctype.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        form = await request.form(max_files=2, max_fields=64)
        try:
            body = validated(
                VideoRequest,
                {
                    k: v
                    for k, v in form.multi_items()
                    if isinstance(v, str) and k != "input_reference"
                },
            )
            upload = form.get("input_reference")
            if upload is not None:  # the first frame: PNG, JPEG or WebP, the edits' limits
                image = await read_upload(server, upload, "input_reference")
        finally:
            await form.close()
    else:
        try:
            fields = await request.json()
        except ValueError:
            raise InvalidRequestError(
                "the body must be JSON or a form (multipart or urlencoded)"
            ) from None
        if not isinstance(fields, dict):
            raise InvalidRequestError("the body must be a JSON object")
        if fields.get("input_reference") is not None:
            raise InvalidRequestError(
                "input_reference is an image file: send it with the other fields as "
                "multipart/form-data",
                param="input_reference",
                code="invalid_image",
            )
        body = validated(VideoRequest, fields)
    key = request.headers.get("idempotency-key")
    row = await _service(request).create(body, key, image)
    return _object_response(row)


@router.get("/v1/videos")
async def list_videos(
    request: Request,
    after: str | None = None,
    limit: int = Query(default=20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
) -> dict:
    store = _service(request).store
    rows, more = await asyncio.to_thread(store.page, after, limit, order)
    data = [video_object(r) for r in rows]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": more,
    }


@router.get("/v1/videos/{video_id}")
async def retrieve(request: Request, video_id: str) -> JSONResponse:
    return _object_response(await _row(request, video_id))


@router.delete("/v1/videos/{video_id}")
async def delete(request: Request, video_id: str) -> dict:
    if not await _service(request).delete(video_id):
        raise NotFoundError(f"no video {video_id!r}", code="video_not_found", param="video_id")
    return {"id": video_id, "object": "video.deleted", "deleted": True}


@router.get("/v1/videos/{video_id}/content")
async def content(
    request: Request, video_id: str, variant: Literal["video", "thumbnail"] = "video"
) -> Response:
    row = await _row(request, video_id)
    if row["status"] == "failed":
        info = ErrorInfo(ErrorKind.VIDEO_FAILED, f"video {video_id} failed: {row['error_message']}")
        return error_response(info, request.state.request_id)
    if row["status"] != "completed":
        raise ConflictError(
            f"video {video_id} is {row['status']}; its content is not ready", code="video_not_ready"
        )
    path = row["file"] if variant == "video" else row["thumbnail"]
    media = "video/mp4" if variant == "video" else "image/png"
    return FileResponse(path, media_type=media)  # serves HTTP Range requests
