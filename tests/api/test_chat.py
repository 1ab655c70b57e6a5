"""/v1/chat/completions on the embedded tiny-omni pipeline, with the official openai SDK."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import time

import httpx
import jsonschema
import openai
import pytest
from PIL import Image

from tests.api.conftest import live_server, run_example
from tests.conftest import wait_until
from tests.reliability.leaks import check_engine, client_of, statuses

pytestmark = pytest.mark.slow
FAULTS = (
    "stage=llm,point=step,kind=slow,match=@slow;"
    "stage=llm,point=template,kind=invalid,match=@badtpl;"
    "stage=llm,point=detokenize,kind=raise,match=@boom"
)
RED = "a large red circle in the center on a white background"
SHAPE = {
    "type": "object",
    "properties": {
        "shape": {"enum": ["circle", "square"]},
        "color": {"enum": ["red", "blue"]},
        "count": {"type": "integer", "minimum": 1, "maximum": 3},
    },
    "required": ["shape", "color", "count"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with live_server(
        tmp_path_factory, "tiny-omni", faults=FAULTS, settings_kw={"keepalive_s": 0.5}
    ) as live:
        yield live


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_a_chat_completion_with_the_openai_sdk(server):
    r = server.client().chat.completions.create(
        model="tiny-omni",
        messages=[
            {"role": "system", "content": "you write captions"},
            {"role": "user", "content": [{"type": "text", "text": "a red circle on white"}]},
        ],
        temperature=0,
    )
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == "tiny-omni"
    (choice,) = r.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content == RED and choice.finish_reason == "stop"
    assert choice.logprobs is None
    u = r.usage
    assert all(isinstance(v, int) for v in (u.prompt_tokens, u.completion_tokens, u.total_tokens))
    assert u.prompt_tokens > 0 and u.completion_tokens > 0
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_max_tokens_cut_the_answer_with_length(server):
    client = server.client()
    r = client.chat.completions.create(
        model="tiny-omni", messages=ask("a red circle"), max_tokens=3
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    r = client.chat.completions.create(
        model="tiny-omni", messages=ask("a red circle"), max_tokens=9, max_completion_tokens=2
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 2
    assert r.choices[0].message.content == "a large"


def test_n_choices_are_the_solo_runs_of_consecutive_seeds(server):
    client = server.client()
    kw = dict(model="tiny-omni", temperature=1.8, max_tokens=12, extra_body={"top_k": 40})
    prompt = ask("zorbly green flimp")
    many = client.chat.completions.create(messages=prompt, n=3, seed=11, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2]
    solos = [
        client.chat.completions.create(messages=prompt, seed=11 + i, **kw).choices[0]
        for i in range(3)
    ]
    assert [c.message.content for c in many.choices] == [s.message.content for s in solos]
    first = client.chat.completions.create(messages=prompt, seed=11, **kw).usage
    assert many.usage.prompt_tokens == first.prompt_tokens  # the prompt, counted once
    assert many.usage.completion_tokens == sum(
        client.chat.completions.create(messages=prompt, seed=11 + i, **kw).usage.completion_tokens
        for i in range(3)
    )


def test_a_stream_with_usage_is_the_same_answer(server):
    client = server.client()
    whole = client.chat.completions.create(
        model="tiny-omni", messages=ask("a blue square"), temperature=0, stop=[" on a"]
    )
    chunks = list(
        client.chat.completions.create(
            model="tiny-omni",
            messages=ask("a blue square"),
            temperature=0,
            stop=[" on a"],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == whole.choices[0].message.content == "a large blue square in the center"
    assert sum(1 for c in chunks[:-1] if c.choices[0].delta.content) >= 5  # token by token
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.model_dump(include={"prompt_tokens", "completion_tokens"}) == (
        whole.usage.model_dump(include={"prompt_tokens", "completion_tokens"})
    )
    assert len({c.id for c in chunks}) == 1


def test_a_stream_of_two_choices_and_logprobs(server):
    chunks = list(
        server.client().chat.completions.create(
            model="tiny-omni",
            messages=ask("a red circle"),
            n=2,
            temperature=0,
            stream=True,
            logprobs=True,
            top_logprobs=2,
        )
    )
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        text = "".join(c.delta.content or "" for c in mine)
        tokens = [e for c in mine if c.logprobs is not None for e in c.logprobs.content]
        assert text == "a large red circle in the center on a black background"
        assert "".join(e.token for e in tokens) == text
        assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in tokens)
        assert mine[-1].finish_reason == "stop"


def test_logprobs_name_every_token(server):
    r = server.client().chat.completions.create(
        model="tiny-omni", messages=ask("a red circle"), logprobs=True, top_logprobs=3, seed=2
    )
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content) == r.choices[0].message.content
    for e in content:
        assert bytes(e.bytes).decode() == e.token and len(e.top_logprobs) == 3
        assert [t.logprob for t in e.top_logprobs] == sorted(
            (t.logprob for t in e.top_logprobs), reverse=True
        )


def test_guided_outputs_keep_their_constraint(server):
    client = server.client()
    r = client.chat.completions.create(
        model="tiny-omni",
        messages=ask("two red circles"),
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SHAPE}},
        temperature=1.0,
        seed=5,
    )
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SHAPE)
    r = client.chat.completions.create(
        model="tiny-omni", messages=ask("x"), response_format={"type": "json_object"}, max_tokens=40
    )
    if r.choices[0].finish_reason == "stop":  # any object: it may run out of tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 40
    for fmt, check in (
        ({"type": "regex", "regex": "(red|blue) [a-z]{3,6}"}, r"(red|blue) [a-z]{3,6}"),
        ({"type": "choice", "choice": ["yes", "no way"]}, r"yes|no way"),
        ({"type": "grammar", "grammar": 'start: "n=" /[0-9]{2}/'}, r"n=[0-9]{2}"),
    ):
        out = client.chat.completions.create(
            model="tiny-omni", messages=ask("go"), response_format=fmt, temperature=1.0, seed=3
        )
        assert out.choices[0].finish_reason == "stop"
        assert re.fullmatch(check, out.choices[0].message.content), out.choices[0].message


def test_modalities_text_and_image_answer_the_drawn_image(server):
    r = server.client().chat.completions.create(
        model="tiny-omni",
        messages=ask("a red circle on white"),
        temperature=0,
        modalities=["text", "image"],
    )
    text, image = r.choices[0].message.content
    assert text == {"type": "text", "text": RED}
    head, data = image["image_url"]["url"].split(",", 1)
    assert image["type"] == "image_url" and head == "data:image/png;base64"
    pixels = Image.open(io.BytesIO(base64.b64decode(data)))
    assert pixels.size == (64, 64) and pixels.mode == "RGB"


IMAGE_PART = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
BAD_REGEX = {"type": "regex", "regex": "(unclosed"}
NOT_SCHEMA = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"not": {}}}}


@pytest.mark.parametrize(
    "kw, code, words",
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "unsupported", "tool"),
        ({"logit_bias": {"1": 5}}, "unsupported", "logit_bias"),
        ({"messages": [IMAGE_PART]}, "unsupported", "image_url"),
        ({"response_format": NOT_SCHEMA}, "unsupported_schema", "'not'"),
        ({"response_format": BAD_REGEX}, "invalid_constraint", "unclosed group"),
        ({"top_logprobs": 2}, None, "top_logprobs needs logprobs"),
        ({"n": 9}, None, "less than or equal to 8"),
        ({"stream": True, "modalities": ["text", "image"]}, "unsupported", "text only"),
        ({"modalities": ["audio"]}, None, "audio"),
    ],
)
def test_what_is_refused_is_a_400_that_says_why(server, kw, code, words):
    body = {"model": "tiny-omni", "messages": ask("a red circle"), **kw}
    with server.http() as http:
        res = http.post("/v1/chat/completions", json=body)
    assert res.status_code == 400, res.text
    err = res.json()["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error"
    if code is not None:
        assert err["code"] == code


def test_an_unknown_model_is_a_404(server):
    with pytest.raises(openai.NotFoundError, match="not served here"):
        server.client().chat.completions.create(model="gpt-9", messages=ask("x"))


def test_a_row_fault_is_its_requests_error_with_an_envelope(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="injected invalid fault at template"):
        client.chat.completions.create(model="tiny-omni", messages=ask("x @badtpl"))
    with pytest.raises(openai.InternalServerError, match="injected raise fault at detokenize"):
        client.chat.completions.create(model="tiny-omni", messages=ask("x @boom"))
    with server.http() as http:  # streamed: an error event, then [DONE]
        text = http.post(
            "/v1/chat/completions",
            json={"model": "tiny-omni", "messages": ask("y @boom"), "stream": True},
        ).text
    assert "event: error" in text and "injected raise fault at detokenize" in text
    assert text.rstrip().endswith("data: [DONE]")
    assert client.chat.completions.create(model="tiny-omni", messages=ask("a red circle"))


def _slow_body(rid: str, stream: bool) -> tuple[dict, dict]:
    body = {"model": "tiny-omni", "messages": ask("a red circle @slow"), "stream": stream}
    return body | {"max_tokens": 80, "temperature": 0}, {"x-request-id": rid}


def test_a_client_that_leaves_mid_generation_aborts_it(server):
    """Streamed (after its first words) and not streamed (while it decodes): the engine ends
    each as aborted within a second, and nothing is left running."""
    orch = server.engine.orchestrator

    def decoding(rid: str) -> bool:
        return any(client_of(k) == rid for k in list(orch.requests))

    async def leave_streaming() -> float:
        body, headers = _slow_body("chat-left-stream", True)
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=30) as http,
            http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as res,
        ):
            assert res.status_code == 200
            async for line in res.aiter_lines():
                if '"content": "a large' in line or '"content":"a large' in line:
                    break
                if '"content": " large"' in line:
                    break
        return time.monotonic()

    async def leave_waiting() -> float:
        body, headers = _slow_body("chat-left-wait", False)
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            task = asyncio.create_task(
                http.post("/v1/chat/completions", json=body, headers=headers)
            )
            assert await asyncio.to_thread(wait_until, lambda: decoding("chat-left-wait"), 10)
            await asyncio.sleep(0.3)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return time.monotonic()

    for leave, rid in ((leave_streaming, "chat-left-stream"), (leave_waiting, "chat-left-wait")):
        left = asyncio.run(leave())
        assert wait_until(lambda rid=rid: not decoding(rid), 2), rid
        assert time.monotonic() - left < 2.0
        assert statuses(server, [rid]) == {rid: "aborted"}
    check_engine(server)


def test_the_chat_example_runs_clean(server, tmp_path):
    lines = run_example("chat_client.py", server, tmp_path)
    assert lines[0] == f"answer: {RED}"
    assert lines[2].startswith("streamed: a small blue square at the top on a")
    assert lines[3].startswith("json: {'shape': ")
    assert lines[4].startswith("drew: a large green triangle") and lines[4].endswith(".png")
    assert [p.name for p in tmp_path.iterdir()] == ["chat-image.png"]
