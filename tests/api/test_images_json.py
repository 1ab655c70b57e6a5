"""The images response's JSON, written with its base64 images spliced in, reads back as the
payload itself."""

from __future__ import annotations

import base64
import json
import os

import pytest

from vllm_omni_like.api.serving import images_json


def _b64(n: int) -> str:
    return base64.b64encode(os.urandom(n)).decode()


@pytest.mark.parametrize(
    "data",
    [
        [{"b64_json": _b64(3000)}],
        [{"b64_json": _b64(10), "revised_prompt": 'a "quoted" prompt \\ with \u00e9 and \n'}],
        [{"b64_json": _b64(7)}, {"b64_json": _b64(8), "revised_prompt": "two"}],
        [{"url": "http://127.0.0.1/v1/files/x.png", "revised_prompt": "r"}],
        [],
    ],
)
def test_reads_back_as_the_payload(data: list[dict[str, str]]) -> None:
    payload = {"created": 1, "data": data, "size": "64x64", "output_format": "png"}
    assert json.loads(images_json(payload)) == payload


def test_only_data() -> None:
    payload = {"data": [{"b64_json": _b64(5)}]}
    assert json.loads(images_json(payload)) == payload


def test_base64_bytes_are_spliced_in_as_text() -> None:
    """image_items hands the base64 over as bytes (no str copy of the megabytes)."""
    raw = os.urandom(3000)
    payload = {"created": 2, "data": [{"b64_json": base64.b64encode(raw), "seed": 5}]}
    got = json.loads(images_json(payload))
    assert base64.b64decode(got["data"][0]["b64_json"]) == raw and got["data"][0]["seed"] == 5
