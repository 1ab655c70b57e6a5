"""/v1/chat/completions: the request schema, its engine requests, and the response shapes."""

from __future__ import annotations

import json
import random
import time
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vllm_omni_like.engine import AsyncOmni
from vllm_omni_like.errors import InvalidRequestError, NotFoundError
from vllm_omni_like.inputs import OmniRequest
from vllm_omni_like.outputs import OmniRequestOutput, StageOutput
from vllm_omni_like.params import GenerationParams, GuideSpec
from vllm_omni_like.protocol.json_schema import check_schema
from vllm_omni_like.protocol.loras import lora_refs, split_model
from vllm_omni_like.protocol.schemas import LoraItem, _Strict

MAX_CHOICES = 8
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls")
UNSUPPORTED_TOO = ("logit_bias", "audio", "prediction", "web_search_options")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")  # (tool_calls etc. are refused below, by name)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = "response"
    schema_: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    """OpenAI's `text`, `json_object`, `json_schema`; and our `regex`, `choice`, `grammar`."""

    type: Literal["text", "json_object", "json_schema", "regex", "choice", "grammar"]
    json_schema: JsonSchemaFormat | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark


class ChatRequest(_Strict):
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # extension: 0 or -1 is off
    seed: int | None = Field(default=None, ge=0, lt=2**31)
    stop: str | list[str] | None = None
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)  # extension
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    modalities: list[str] | None = None
    lora: list[LoraItem] | None = None  # with images: the diffusion stage's LoRA adapters
    # refused with a 400 `unsupported` when set (a model without tool calling)
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    logit_bias: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    # accepted and ignored, as OpenAI's bookkeeping fields
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    reasoning_effort: str | None = None

    @model_validator(mode="after")
    def _fields_together(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream: true")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > 4 or not all(stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def wants_image(self) -> bool:
        return "image" in (self.modalities or ["text"])


def _refuse_unsupported(body: ChatRequest) -> None:
    for name in (*UNSUPPORTED, *UNSUPPORTED_TOO):
        if getattr(body, name) not in (None, [], {}):
            what = "tool calling" if name in UNSUPPORTED else name
            raise InvalidRequestError(
                f"{what} is not supported by this server's models", param=name, code="unsupported"
            )
    for i, m in enumerate(body.messages):
        if m.model_extra and any(k in m.model_extra for k in ("tool_calls", "function_call")):
            raise InvalidRequestError(
                "tool calls are not supported", param=f"messages.{i}", code="unsupported"
            )
    extra = set(body.modalities or ["text"]) - {"text", "image"}
    if extra or (not body.modalities and body.modalities is not None):
        raise InvalidRequestError(
            f"modalities may be 'text' and 'image', not {sorted(extra) or '[]'}",
            param="modalities",
        )


def _turns(body: ChatRequest) -> tuple[tuple[str, str], ...]:
    """(role, text) per message; a content list's text parts joined (text only)."""
    turns = []
    for i, m in enumerate(body.messages):
        if isinstance(m.content, list):
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise InvalidRequestError(
                        f"content parts of type {part.type!r} are not supported (text only)",
                        param=f"messages.{i}.content",
                        code="unsupported",
                    )
            text = "\n".join(p.text or "" for p in m.content)
        else:
            text = m.content or ""
        turns.append((m.role, text))
    return tuple(turns)


def guide_of(fmt: ResponseFormat | None) -> GuideSpec | None:
    """The constraint a response_format asks for (a 400 when it is malformed)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GuideSpec("json_schema", json.dumps({"type": "object"}))
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise InvalidRequestError(
                "response_format json_schema needs json_schema.schema", param="response_format"
            )
        check_schema(fmt.json_schema.schema_)
        return GuideSpec("json_schema", json.dumps(fmt.json_schema.schema_))
    value = getattr(fmt, fmt.type)
    if not value:
        raise InvalidRequestError(
            f"response_format {fmt.type} needs its {fmt.type!r} field", param="response_format"
        )
    return GuideSpec(fmt.type, json.dumps(value) if fmt.type == "choice" else value)


def chat_pipeline(engine: AsyncOmni, model: str | None) -> str:
    """The named pipeline (it must start with an LLM stage), or the first served one that does."""
    names = [n for n in engine.pipeline_names if engine.config_of(n).stages[0].kind == "llm"]
    if model is None:
        if not names:
            raise NotFoundError(
                "no served model answers chat", param="model", code="model_not_found"
            )
        return names[0]
    if model not in engine.pipeline_names:
        served = ", ".join(engine.pipeline_names)
        raise NotFoundError(
            f"model {model!r} is not served here; served: {served}",
            param="model",
            code="model_not_found",
        )
    if model not in names:
        raise InvalidRequestError(
            f"model {model!r} has no language model stage to chat with", param="model"
        )
    return model


def chat_requests(
    engine: AsyncOmni, body: ChatRequest, request_id: str, client_id: str | None
) -> list[OmniRequest]:
    """One engine request per choice (they share a batch in the LLM stage)."""
    _refuse_unsupported(body)
    named, adapter = split_model(engine, body.model)
    pipeline = chat_pipeline(engine, named)
    loras = lora_refs(engine, pipeline, body.lora, adapter)
    if loras and not body.wants_image:
        raise InvalidRequestError(
            "LoRA adapters run on a chat's images: ask for them (modalities)", param="lora"
        )
    turns = _turns(body)
    base = body.seed if body.seed is not None else random.randrange(2**31 - MAX_CHOICES)
    params = GenerationParams(
        max_new_tokens=body.max_completion_tokens or body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=max(body.top_k, 0),
        stop=body.stops,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logprobs=body.logprobs,
        top_logprobs=body.top_logprobs or 0,
        stream_text=body.stream,
        guide=guide_of(body.response_format),
        messages=turns,
        loras=loras,
    )
    last = None if body.wants_image else 0
    prompt = next((t for r, t in reversed(turns) if r == "user"), turns[-1][1])
    return [
        OmniRequest(
            f"{request_id}-{i}",
            prompt,
            pipeline,
            replace(params, seed=base + i),
            client_id=client_id,
            last_stage=last,
            encodes_png=body.wants_image,  # (its images go out as PNG data URLs)
        )
        for i in range(body.n)
    ]


def usage(outputs: list[OmniRequestOutput]) -> dict[str, int]:
    """Token counts (integers, always): the prompt once, every choice's completion."""
    llm = [llm_output(o) for o in outputs]
    prompt = next((s.prompt_tokens for s in llm if s is not None), 0)
    completion = sum(s.completion_tokens for s in llm if s is not None)
    return {
        "prompt_tokens": int(prompt),
        "completion_tokens": int(completion),
        "total_tokens": int(prompt + completion),
    }


def llm_output(output: OmniRequestOutput) -> StageOutput | None:
    """The LLM stage's output of a request (its first stage), if it got that far."""
    return next(iter(output.stage_outputs.values()), None)


def llm_result(output: OmniRequestOutput) -> StageOutput:
    """The LLM stage's output of a request that succeeded."""
    llm = llm_output(output)
    if llm is None:
        raise ValueError(f"request {output.request_id} has no LLM output")
    return llm


def completion_id(request_id: str) -> str:
    return f"chatcmpl-{request_id}"


def envelope_head(request_id: str, model: str, kind: str) -> dict[str, Any]:
    return {
        "id": completion_id(request_id),
        "object": kind,
        "created": int(time.time()),
        "model": model,
    }
