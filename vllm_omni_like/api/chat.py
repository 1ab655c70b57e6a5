"""POST /v1/chat/completions: a pipeline's LLM stage as a chat model (and, with
`modalities: ["text", "image"]`, the image the pipeline draws from the answer).

`n` choices are `n` engine requests (seeds `seed`, `seed + 1`, ...) that share the LLM stage's
batch. A client that disconnects aborts all of them, streamed or not.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from vllm_omni_like.api.serving import SSE_HEADERS, Server, open_all, run_to_outputs, sse
from vllm_omni_like.engine.async_omni import RequestStream
from vllm_omni_like.errors import InvalidRequestError
from vllm_omni_like.media import encode_image
from vllm_omni_like.outputs import OmniRequestOutput, RequestProgress, TextDelta
from vllm_omni_like.protocol.chat import (
    ChatRequest,
    chat_requests,
    envelope_head,
    llm_result,
    usage,
)
from vllm_omni_like.protocol.envelope import envelope

router = APIRouter()


def _logprobs(entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    return {"content": entries, "refusal": None} if entries is not None else None


def _content(output: OmniRequestOutput, wants_image: bool) -> Any:
    """The message content: the LLM's text; with the image modality, a list of parts (the
    text, then each image as a PNG data URL, as vllm-omni answers)."""
    text = llm_result(output).text or ""
    if not wants_image:
        return text
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    for image in output.result.images:
        data = base64.b64encode(encode_image(image.pixels, scanlines=image.scanlines)).decode()
        parts.append({"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}})
    return parts


def _response(body: ChatRequest, model: str, rid: str, outputs: list[OmniRequestOutput]) -> dict:
    choices = []
    for i, out in enumerate(outputs):
        llm = llm_result(out)
        choices.append(
            {
                "index": i,
                "message": {
                    "role": "assistant",
                    "content": _content(out, body.wants_image),
                    "refusal": None,
                },
                "logprobs": _logprobs(llm.logprobs) if body.logprobs else None,
                "finish_reason": llm.finish_reason or "stop",
            }
        )
    return {
        **envelope_head(rid, model, "chat.completion"),
        "choices": choices,
        "usage": usage(outputs),
    }


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, body: ChatRequest):
    server: Server = request.app.state.server
    rid = request.state.engine_request_id
    omnis = chat_requests(server.engine, body, rid, request.state.request_id)
    model = omnis[0].pipeline
    if body.stream:
        if body.wants_image:
            raise InvalidRequestError(
                "a streamed chat completion carries text only; ask for the image without stream",
                param="modalities",
                code="unsupported",
            )
        streams = open_all(server, request, omnis, progress=True)
        return StreamingResponse(
            _stream(server, streams, body, model, rid, request.state.request_id),
            media_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    outputs = await run_to_outputs(request, server, omnis)
    return JSONResponse(await asyncio.to_thread(_response, body, model, rid, outputs))


async def _merged(
    streams: list[RequestStream], keepalive: float
) -> AsyncGenerator[tuple[Any, ...], None]:
    """(choice index, event) from every stream as they come; (None, None) after `keepalive`
    seconds of silence."""
    queue: asyncio.Queue[tuple] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        while (event := await stream.next()) is not None:
            await queue.put((i, event))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        finished = 0
        while finished < len(streams):
            try:
                async with asyncio.timeout(keepalive):  # not wait_for: see RequestStream.next
                    i, event = await queue.get()
            except TimeoutError:
                yield None, None
                continue
            finished += isinstance(event, OmniRequestOutput)
            yield i, event
    finally:
        for t in tasks:
            t.cancel()


async def _stream(
    server: Server,
    streams: list[RequestStream],
    body: ChatRequest,
    model: str,
    rid: str,
    client_id: str,
) -> AsyncIterator[str]:
    """SSE chunks: each choice's role, its text as it is made, its finish reason; with
    `stream_options.include_usage`, a last chunk with the usage (and `usage: null` before)."""
    head = envelope_head(rid, model, "chat.completion.chunk")
    with_usage = body.stream_options is not None and body.stream_options.include_usage
    sent = [""] * len(streams)
    finals: list[OmniRequestOutput] = []

    def chunk(i: int, delta: dict, finish: str | None = None, logprobs=None) -> str:
        data = {
            **head,
            "choices": [
                {
                    "index": i,
                    "delta": delta,
                    "logprobs": _logprobs(logprobs) if body.logprobs else None,
                    "finish_reason": finish,
                }
            ],
        }
        if with_usage:
            data["usage"] = None
        return sse(None, data)

    merged = _merged(streams, server.settings.keepalive_s)
    try:
        for i in range(len(streams)):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for i, event in merged:
            if event is None:
                yield ": keep-alive\n\n"
                continue
            if isinstance(event, RequestProgress):
                delta = event.previews
                if isinstance(delta, TextDelta) and (delta.text or delta.logprobs):
                    sent[i] += delta.text
                    yield chunk(i, {"content": delta.text}, logprobs=delta.logprobs)
                continue
            if event.error is not None:
                yield sse("error", envelope(event.error, client_id))
                yield "data: [DONE]\n\n"
                return
            finals.append(event)
            llm = llm_result(event)
            rest = (llm.text or "")[len(sent[i]) :]  # (nothing, unless a delta was missed)
            yield chunk(i, {"content": rest} if rest else {}, llm.finish_reason or "stop")
        if with_usage:
            yield sse(None, {**head, "choices": [], "usage": usage(finals)})
        yield "data: [DONE]\n\n"
    finally:
        for s in streams:  # the client went away before the end: abort everywhere
            s.close()
        await merged.aclose()  # its readers stop now, not when it is collected
