"""The one request -> engine -> response path that images, edits and videos share."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request

from vllm_omni_like.api.background import retrieve
from vllm_omni_like.api.file_store import FileStore
from vllm_omni_like.api.video_jobs import VideoService
from vllm_omni_like.config import ServerSettings
from vllm_omni_like.engine import AsyncOmni
from vllm_omni_like.engine.async_omni import RequestStream
from vllm_omni_like.errors import (
    AbortedError,
    EngineDeadError,
    UnavailableError,
)
from vllm_omni_like.inputs import OmniRequest
from vllm_omni_like.media import encode_image
from vllm_omni_like.outputs import OmniRequestOutput, RequestProgress
from vllm_omni_like.protocol.envelope import envelope
from vllm_omni_like.protocol.requests import image_items
from vllm_omni_like.protocol.schemas import ImageRequest

T = TypeVar("T")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
logger = logging.getLogger(__name__)


@dataclass
class Server:
    """What every route needs; lives in `app.state.server`."""

    engine: AsyncOmni
    settings: ServerSettings
    files: FileStore
    videos: VideoService | None = None  # set by the app's lifespan once the engine started
    start_error: str | None = None
    drain_deadline: float | None = None  # event-loop time the drain ends (set on SIGTERM)

    @property
    def draining(self) -> bool:
        return self.drain_deadline is not None

    def begin_drain(self, deadline: float) -> None:
        """Shutdown began: no new video job starts; what runs may finish until `deadline`."""
        self.drain_deadline = deadline
        if self.videos is not None:
            self.videos.begin_drain()

    def cut_off(self, message: str) -> None:
        """The drain is over: every request still in the engine ends now with a 503."""
        if self.engine.started:
            self.engine.cut_off(message)

    def ensure_ready(self) -> None:
        if self.start_error is not None:
            raise EngineDeadError(f"the engine failed to start: {self.start_error}")
        if not self.engine.started:
            raise UnavailableError("the engine is starting; retry shortly", code="starting")
        self.engine.check_health()

    def open(
        self, request: Request | None, omni: OmniRequest, progress: bool = True
    ) -> RequestStream:
        """Submit to the engine; from here on a failure is the request's final status."""
        self.ensure_ready()
        stream = self.engine.open(omni, progress)
        if request is not None:
            request.state.admitted = True
        return stream


async def until_disconnect(request: Request) -> None:
    # receive() also resumes reading the socket, which is how a closed connection is noticed
    while (await request.receive())["type"] != "http.disconnect":
        pass


def open_all(
    server: Server, request: Request, omnis: list[OmniRequest], progress: bool
) -> list[RequestStream]:
    """Submit every request; if one is refused, those admitted before it are aborted."""
    streams: list[RequestStream] = []
    try:
        for omni in omnis:
            streams.append(server.open(request, omni, progress))
    except BaseException:
        for s in streams:
            s.close()
        raise
    return streams


async def run_to_outputs(
    request: Request, server: Server, omnis: list[OmniRequest]
) -> list[OmniRequestOutput]:
    """Run every request to its final output. The first to fail fails the call with its
    error, and a client that disconnects aborts them: either way the others are aborted at
    once."""

    async def final(stream: RequestStream) -> OmniRequestOutput:
        while not isinstance(event := await stream.next(), OmniRequestOutput):
            pass
        if event.error is not None:
            raise event.error.error()
        return event

    streams = open_all(server, request, omnis, progress=False)
    gone = asyncio.create_task(until_disconnect(request))
    work: asyncio.Future[list[OmniRequestOutput]] = asyncio.ensure_future(
        asyncio.gather(*(final(s) for s in streams))
    )
    try:
        either: set[asyncio.Future[Any]] = {work, gone}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise AbortedError("the client disconnected")
        return work.result()
    finally:
        gone.cancel()
        if work.cancel():  # read once it ends
            work.add_done_callback(retrieve)
        for s in streams:
            s.close()


def image_response(
    server: Server,
    output: OmniRequestOutput,
    body: ImageRequest,
    base_url: str,
    omni: OmniRequest,
) -> bytes:
    """Encode and package the images as the response's JSON (CPU work: runs in a thread, so
    the megabytes of a large image's JSON are not written on the event loop)."""
    as_url = body.response_format == "url"
    items = image_items(output, body.output_format, body.output_compression, as_b64=not as_url)
    if as_url:
        for item in items:
            name = server.files.put(item.pop("bytes"), body.output_format, omni)
            item["url"] = f"{base_url}v1/files/{name}"
    first = output.result.images[0].pixels
    return images_json(
        {
            "created": int(time.time()),
            "data": items,
            "size": f"{first.shape[1]}x{first.shape[0]}",
            "output_format": body.output_format,
        }
    )


def images_json(payload: dict[str, Any]) -> bytes:
    """`payload` as JSON, each item's base64 image (bytes, or str) spliced in as it is: its
    alphabet needs no escaping, and json.dumps would scan the megabytes of a large image for
    nothing (25 ms for a 1024x1024 PNG on a 2-core CPU, against 1 ms). The pieces are joined
    once: each concatenation of a 4 MB string is a fresh allocation, and a server's fresh
    pages cost their page faults (14.5 ms a request for the earlier concatenations, sampled
    in a null-stage server on that CPU)."""
    head = json.dumps({k: v for k, v in payload.items() if k != "data"})[:-1]
    pieces = [head.encode(), b", " if len(head) > 1 else b"", b'"data": [']
    for i, item in enumerate(payload["data"]):
        pieces.append(b", " if i else b"")
        if "b64_json" not in item:
            pieces.append(json.dumps(item).encode())
            continue
        b64 = item["b64_json"]
        rest = json.dumps({k: v for k, v in item.items() if k != "b64_json"})[1:-1]
        pieces += [b'{"b64_json": "', b64.encode() if isinstance(b64, str) else b64, b'"']
        pieces.append((", " + rest if rest else "").encode() + b"}")
    pieces.append(b"]}")
    return b"".join(pieces)


def sse(event: str | None, data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data)
    return (f"event: {event}\n" if event else "") + f"data: {payload}\n\n"


async def stream_images(
    server: Server, stream: RequestStream, body: ImageRequest, prefix: str, client_id: str
) -> AsyncIterator[str]:
    """SSE: partial images from real intermediate steps, then completed, then [DONE]."""
    index, keepalive = 0, server.settings.keepalive_s
    last_sent = time.monotonic()
    try:
        while True:
            wait = max(0.0, keepalive - (time.monotonic() - last_sent))
            try:
                event = await stream.next(timeout=wait)
            except TimeoutError:
                event = None
            if event is None or (isinstance(event, RequestProgress) and event.previews is None):
                if time.monotonic() - last_sent >= keepalive:  # silence: a comment line
                    last_sent = time.monotonic()
                    yield ": keep-alive\n\n"
                continue
            last_sent = time.monotonic()
            if isinstance(event, RequestProgress):
                data = await asyncio.to_thread(
                    encode_image, event.previews, body.output_format, body.output_compression
                )
                h, w = event.previews.shape[:2]
                yield sse(
                    f"{prefix}.partial_image",
                    {
                        "type": f"{prefix}.partial_image",
                        "b64_json": base64.b64encode(data).decode(),
                        "partial_image_index": index,
                        "size": f"{w}x{h}",
                        "output_format": body.output_format,
                        "created_at": int(time.time()),
                    },
                )
                index += 1
                continue
            if event.error is not None:
                yield sse("error", envelope(event.error, client_id))
            else:
                items = await asyncio.to_thread(
                    image_items, event, body.output_format, body.output_compression
                )
                h, w = event.result.images[0].pixels.shape[:2]
                for item in items:
                    yield sse(
                        f"{prefix}.completed",
                        {
                            "type": f"{prefix}.completed",
                            "b64_json": item["b64_json"].decode(),
                            "size": f"{w}x{h}",
                            "output_format": body.output_format,
                            "created_at": int(time.time()),
                            "seed": item["seed"],
                            "revised_prompt": item.get("revised_prompt"),
                        },
                    )
            yield "data: [DONE]\n\n"
            return
    finally:
        stream.close()  # the client went away before the end: abort everywhere
