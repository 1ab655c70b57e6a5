"""/v1/images through the real openai SDK and raw HTTP, on null pipelines."""

from __future__ import annotations

import base64
import io
import time

import httpx
import numpy as np
import openai
import pytest
from PIL import Image


def _png(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def test_generate_with_the_sdk(null_server):
    client = null_server.client()
    res = client.images.generate(
        prompt="red circle",
        size="48x32",
        n=2,
        model="null-omni",
        extra_body={"seed": 5, "num_inference_steps": 3},
    )
    assert len(res.data) == 2
    assert [d.model_extra["seed"] for d in res.data] == [5, 6]
    assert all(d.revised_prompt.startswith("red circle (rewritten #") for d in res.data)
    img = _png(res.data[0].b64_json)
    assert img.size == (48, 32) and img.format == "PNG"
    assert res.size == "48x32" and res.output_format == "png"
    again = client.images.generate(
        prompt="red circle",
        size="48x32",
        model="null-omni",
        extra_body={"seed": 5, "num_inference_steps": 3},
    )
    assert again.data[0].b64_json == res.data[0].b64_json  # same seed, same bytes


@pytest.mark.parametrize(("fmt", "pil"), [("jpeg", "JPEG"), ("webp", "WEBP")])
def test_output_formats(null_server, fmt, pil):
    res = null_server.client().images.generate(
        prompt="x", model="null-image", output_format=fmt, output_compression=40
    )
    assert _png(res.data[0].b64_json).format == pil


def test_url_response_format_serves_an_expiring_file(null_server):
    res = null_server.client().images.generate(
        prompt="x", model="null-image", response_format="url"
    )
    url = res.data[0].url
    assert url.startswith(null_server.url + "/v1/files/") and len(url.rsplit("/", 1)[1]) > 30
    got = httpx.get(url)
    assert got.status_code == 200 and got.headers["content-type"] == "image/png"
    name = url.rsplit("/", 1)[1]
    null_server.app.state.server.files._expiry[name] = time.monotonic() - 1
    gone = httpx.get(url)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "file_not_found"


def test_streaming_partial_images_then_completed(null_server):
    stream = null_server.client().images.generate(
        prompt="x",
        model="null-image",
        stream=True,
        partial_images=2,
        extra_body={"num_inference_steps": 6, "seed": 1},
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    final = np.asarray(_png(events[-1].b64_json)).astype(int)
    first = np.asarray(_png(events[0].b64_json)).astype(int)
    # intermediate steps: the first partial is further from the final image than the second
    second = np.asarray(_png(events[1].b64_json)).astype(int)
    assert np.abs(first - final).mean() > np.abs(second - final).mean() > 0


def test_stream_error_after_start_is_one_event_then_done(null_server):
    with null_server.http() as http:
        r = http.post(
            "/v1/images/generations",
            json={"prompt": "x @fail", "model": "null-image", "stream": True},
        )
        assert r.status_code == 200
        chunks = [c for c in r.text.split("\n\n") if c.strip()]
    assert chunks[0].startswith('event: error\ndata: {"error"')
    assert "injected raise fault" in chunks[0]
    assert chunks[-1] == "data: [DONE]"


def test_streaming_sends_keepalives_while_waiting(null_server):
    with null_server.http() as http:
        r = http.post(
            "/v1/images/generations",
            json={
                "prompt": "x @delay=0.1",
                "model": "null-image",
                "stream": True,
                "num_inference_steps": 6,
            },
        )
    assert ": keep-alive" in r.text and r.text.endswith("data: [DONE]\n\n")


def test_stream_validation_happens_before_the_stream(null_server):
    with null_server.http() as http:
        r = http.post(
            "/v1/images/generations",
            json={"prompt": "x", "model": "null-image", "stream": True, "size": "5000x64"},
        )
    assert r.status_code == 400 and r.json()["error"]["param"] == "size"


def test_sdk_error_types(null_server):
    client = null_server.client(max_retries=2)
    before = null_server.engine.stats.requests_total
    with pytest.raises(openai.InternalServerError) as info:
        client.images.generate(prompt="boom @fail", model="null-image")
    assert info.value.status_code == 500
    assert info.value.response.headers["x-should-retry"] == "false"
    # x-should-retry: false kept the SDK from sending it three times
    assert null_server.engine.stats.requests_total == before + 1
    with pytest.raises(openai.BadRequestError) as info:
        client.images.generate(prompt="x @invalid", model="null-image")
    assert info.value.body["stage"] == "diffusion"
    with pytest.raises(openai.NotFoundError) as info:
        client.images.generate(prompt="x", model="no-such-model")
    assert info.value.body["code"] == "model_not_found"


@pytest.mark.parametrize(("fmt", "png"), [("png", True), ("jpeg", False), ("webp", False)])
def test_a_png_request_asks_its_stages_for_filtered_rows(null_server, fmt, png):
    """The request says whether its images will be PNGs (a GPU stage then filters their rows
    on the device), and each stage's request carries it."""
    from vllm_omni_like.config import Limits
    from vllm_omni_like.protocol.requests import image_request
    from vllm_omni_like.protocol.schemas import ImageRequest

    body = ImageRequest(prompt="x", model="null-image", output_format=fmt)
    omni = image_request(null_server.engine, body, Limits(), "r-png")
    assert omni.encodes_png is png
    pipeline = null_server.engine.orchestrator.pipelines["null-image"]
    assert pipeline.stage_request(omni, 0, None).encodes_png is png
