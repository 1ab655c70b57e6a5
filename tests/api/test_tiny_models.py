"""The server on the embedded tiny image model: edits with a mask, partial images, batching."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from tests.api.conftest import live_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    with live_server(tmp_path_factory, "tiny-image") as server:
        yield server


def _png_bytes(array: np.ndarray, mode: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array, mode).save(buf, format="PNG")
    return buf.getvalue()


def _decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")).astype(int)


def test_edit_with_an_openai_mask_changes_only_the_transparent_region(tiny_server):
    base = np.full((64, 64, 3), 200, dtype=np.uint8)
    mask = np.full((64, 64, 4), 255, dtype=np.uint8)
    mask[:, :32, 3] = 0  # fully transparent = the region to edit (OpenAI's convention)
    res = tiny_server.client().images.edit(
        image=("base.png", _png_bytes(base, "RGB"), "image/png"),
        mask=("mask.png", _png_bytes(mask, "RGBA"), "image/png"),
        prompt="a blue square",
        extra_body={"seed": 3, "num_inference_steps": 4, "strength": 1.0},
    )
    out = _decode(res.data[0].b64_json)
    assert out.shape == (64, 64, 3)
    painted = np.abs(out[:, :24] - 200).mean()
    kept = np.abs(out[:, 40:] - 200).mean()
    assert painted > kept


def test_edit_accepts_image_array_field(tiny_server):
    base = np.full((64, 64, 3), 100, dtype=np.uint8)
    with tiny_server.http() as http:
        r = http.post(
            "/v1/images/edits",
            data={"prompt": "a red circle", "seed": "1", "num_inference_steps": "3"},
            files=[("image[]", ("a.png", _png_bytes(base, "RGB"), "image/png"))],
        )
    assert r.status_code == 200, r.text
    assert _decode(r.json()["data"][0]["b64_json"]).shape == (64, 64, 3)


def test_partial_images_come_from_intermediate_denoising_steps(tiny_server):
    events = list(
        tiny_server.client().images.generate(
            prompt="a red circle",
            stream=True,
            partial_images=2,
            extra_body={"seed": 2, "num_inference_steps": 6},
        )
    )
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + [
        "image_generation.completed"
    ]
    partials = [_decode(e.b64_json) for e in events[:2]]
    final = _decode(events[-1].b64_json)
    assert all(p.shape == final.shape for p in partials)
    assert all(np.abs(p - final).mean() > 0 for p in partials)  # not the final image again


def test_prompt_over_the_text_encoder_is_a_400_from_the_stage(tiny_server):
    with tiny_server.http() as http:
        r = http.post("/v1/images/generations", json={"prompt": "red " * 40})
    body = r.json()["error"]
    assert r.status_code == 400 and body["code"] == "prompt_too_long"
    assert body["stage"] == "diffusion"
