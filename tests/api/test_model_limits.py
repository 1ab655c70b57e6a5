"""What a request may ask of a model: the model's own limits, shown by /v1/models and enforced at
admission (400 naming the limit, before anything is queued); video sizes and frames; edits."""

from __future__ import annotations

import base64
import io
import time

import numpy as np
import openai
import pytest
from PIL import Image

from tests.api.conftest import live_server
from vllm_omni_like.shapes import world
from vllm_omni_like.video_codec import decode_video

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # max_steps is overridden as a flag would (every stage); the rest are the models' own
    with live_server(
        tmp_path_factory, "tiny-image", "tiny-video", stage_kw={"max_steps": 60}
    ) as server:
        yield server


def _png(array: np.ndarray, mode: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array, mode).save(buf, format="PNG")
    return buf.getvalue()


def _error(r, status: int, param: str | None, code: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code), err
    return err["message"]


def test_models_list_and_retrieve_show_each_models_limits(tiny):
    client = tiny.client()
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {"tiny-image", "tiny-video"}
    image = client.models.retrieve("tiny-image").model_dump()
    assert image["limits"] == {
        "output": "image",
        "max_side": 128,  # twice the 64x64 it was trained for
        "max_pixels": 4 * 128 * 128,
        "max_steps": 60,  # the override
        "min_steps": 1,
        "default_steps": 20,
        "size_multiple": 8,
        "default_width": 64,
        "default_height": 64,
        # the names a request's `scheduler` may take (models/schedulers.py)
        "schedulers": [
            "ddim",
            "pndm",
            "euler",
            "euler-a",
            "dpm++2m",
            "dpm++2m-karras",
            "unipc",
            "dpm++2m-sde",
            "dpm++3m",
            "pndm-prk",
            "unipc-3",
        ],
        "needs_image": False,  # it makes images from text too
        "experts": 1,  # one denoiser (Wan2.2-A14B: 2)
        "edit_strength": True,  # its edits (img2img) take a strength
        "image_to_video": False,  # (a video model that starts from an input image)
        "modes": ["text2img", "edit", "inpaint"],  # (a 9-channel UNet's: inpaint alone)
    }
    video = client.models.retrieve("tiny-video").model_dump()["limits"]
    assert not video["image_to_video"] and not video["needs_image"]  # text to video only
    assert video["schedulers"] == ["unipc", "flow-euler"]
    assert (video["max_side"], video["max_frames"], video["default_fps"]) == (64, 33, 8)
    assert video["frame_multiple"] == 2 and listed["tiny-video"].model_dump()["limits"] == video
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("nope")
    assert "served: tiny-image, tiny-video" in exc.value.body["message"]


def test_work_past_the_models_limits_is_a_400_at_admission(tiny):
    with tiny.http() as http:
        started = time.monotonic()
        r = http.post("/v1/images/generations", json={"prompt": "red circle", "size": "1024x1024"})
        assert time.monotonic() - started < 1.0  # refused before anything ran
        message = _error(r, 400, "size", "invalid_size")
        assert message == (
            "size 1024x1024 is not supported by tiny-image: it makes width and height multiples "
            "of 8 from 8 to 128 (max_side 128)"
        )
        r = http.post("/v1/images/generations", json={"prompt": "x", "size": "128x128", "n": 10})
        assert _error(r, 400, "n", "invalid_size") == (
            "n x width x height = 10 x 128 x 128 is over tiny-image's limit of 65536 pixels "
            "(max_pixels)"
        )
        r = http.post("/v1/images/generations", json={"prompt": "x", "num_inference_steps": 61})
        assert _error(r, 400, "num_inference_steps", "invalid_value") == (
            "num_inference_steps 61 is over tiny-image's limit of 60 (max_steps)"
        )
        r = http.post(
            "/v1/images/generations",
            json={"prompt": "red circle", "size": "128x64", "num_inference_steps": 2},
        )
        assert r.status_code == 200 and r.json()["size"] == "128x64"
    snap = tiny.engine.stats.snapshot()
    assert sum(snap["final"].values()) == snap["requests_total"]


def test_a_second_guidance_scale_for_one_denoiser_is_a_400_at_admission(tiny):
    with tiny.http() as http:
        started = time.monotonic()
        r = http.post("/v1/videos", json={"prompt": "red circle", "guidance_scale_2": 3.0})
        assert time.monotonic() - started < 1.0  # refused before anything ran
        assert _error(r, 400, "guidance_scale_2", "invalid_value") == (
            "guidance_scale_2 is the low-noise expert's scale; tiny-video has one denoiser"
        )
    snap = tiny.engine.stats.snapshot()
    assert sum(snap["final"].values()) == snap["requests_total"]


def test_openai_video_sizes_run_at_the_nearest_size_and_the_object_says_so(tiny):
    client = tiny.client()
    video = client.videos.create_and_poll(
        prompt="a red circle moving right on a blue background",
        size="720x1280",
        seconds="4",
        extra_body={"num_inference_steps": 2, "seed": 1},
        poll_interval_ms=50,
    )
    assert video.status == "completed", video.error
    body = video.model_dump()
    assert (body["size"], body["seconds"], body["num_frames"], body["fps"]) == (
        "32x64",
        "4.125",
        33,
        8,
    )
    frames = decode_video(client.videos.download_content(video.id).read())
    assert frames.shape[:3] == (33, 64, 32)
    with tiny.http() as http:
        wide = http.post(
            "/v1/videos", data={"prompt": "x", "size": "1280x720", "num_inference_steps": "1"}
        )
        assert wide.status_code == 200 and wide.json()["size"] == "64x32"
        bad = http.post("/v1/videos", data={"prompt": "x", "size": "72x64"})
        assert _error(bad, 400, "size", "invalid_size") == (
            "size 72x64 is not supported by tiny-video: it makes width and height multiples of "
            "16 from 16 to 64 (max_side 64)"
        )
        long = http.post("/v1/videos", data={"prompt": "x", "seconds": "8"})
        assert _error(long, 400, "seconds", "invalid_value") == (
            "8 s x 8 fps needs 65 frames, over tiny-video's limit of 33 frames (max_frames): "
            "at 8 fps at most 4 seconds"
        )
        frames = http.post("/v1/videos", json={"prompt": "x", "num_frames": 40})
        assert _error(frames, 400, "num_frames", "invalid_value").startswith("num_frames 40 ")


def _edit(http, image: bytes, mask: bytes | None = None, **fields):
    files = [("image", ("in.png", image, "image/png"))]
    if mask is not None:
        files.append(("mask", ("mask.png", mask, "image/png")))
    prompt = "a large red square at the left on a white background"
    data = {"prompt": prompt, "seed": "3", **{k: str(v) for k, v in fields.items()}}
    return http.post("/v1/images/edits", data=data, files=files)


def test_an_edit_upload_larger_than_the_model_is_fitted(tiny):
    big = np.full((150, 300, 3), 120, np.uint8)  # 300x150: over max_side 128
    with tiny.http() as http:
        r = _edit(http, _png(big, "RGB"), num_inference_steps=2)
    assert r.status_code == 200, r.text
    assert r.json()["size"] == "128x64"  # aspect kept, rounded down to multiples of 8


@pytest.mark.parametrize(("strength", "steps"), [(0.04, 20), (0.5, 1)])
def test_strength_times_steps_under_one_still_runs_a_step(tiny, strength, steps):
    base = np.full((64, 64, 3), 200, np.uint8)
    with tiny.http() as http:
        r = _edit(http, _png(base, "RGB"), strength=strength, num_inference_steps=steps)
    assert r.status_code == 200, r.text


def test_a_strength_no_step_can_serve_is_a_400_that_says_why(tiny):
    base = np.full((64, 64, 3), 200, np.uint8)
    with tiny.http() as http:
        r = _edit(http, _png(base, "RGB"), strength=0.001)
    message = _error(r, 400, "strength", "invalid_value")
    assert message == (
        "strength 0.001 runs no denoising step within tiny-image's limit of 60 steps "
        "(int(num_inference_steps x strength) must be >= 1): use a strength of at least 0.0166667"
    )


def test_masks_are_read_by_alpha_or_as_greyscale(tiny):
    base = world.render(world.Scene("square", "blue", "left", "white"))
    grey = np.zeros((64, 64), np.uint8)
    grey[:, :32] = 255  # white marks the edit
    opaque = np.full((64, 64, 4), 255, np.uint8)
    opaque[:, 32:, :3] = 0  # fully opaque RGBA: read as greyscale (left white = edit)
    with tiny.http() as http:
        for mask in (_png(grey, "L"), _png(opaque, "RGBA")):
            r = _edit(http, _png(base, "RGB"), mask, strength=0.9, num_inference_steps=20)
            assert r.status_code == 200, r.text
            data = base64.b64decode(r.json()["data"][0]["b64_json"])
            out = np.asarray(Image.open(io.BytesIO(data))).astype(int)
            kept = np.abs(out[:, 40:] - base[:, 40:]).mean()
            changed = np.abs(out[:, :24] - base[:, :24]).mean()
            assert kept < 10 and changed > 3 * kept, (kept, changed)
        empty = _edit(http, _png(base, "RGB"), _png(np.zeros((64, 64), np.uint8), "L"))
        assert _error(empty, 400, "mask", "invalid_image") == (
            "mask marks nothing to edit: it has no transparent pixel (alpha) and no white pixel "
            "(greyscale). Mark the region to edit with fully transparent pixels (OpenAI's PNG "
            "with alpha) or white on black (greyscale)"
        )


def test_a_scheduler_the_model_does_not_run_is_a_400_naming_those_it_does(tiny):
    client = tiny.client()
    with pytest.raises(openai.BadRequestError) as exc:
        client.images.generate(prompt="red circle", extra_body={"scheduler": "flow-euler"})
    err = exc.value.body
    assert (err["param"], err["code"]) == ("scheduler", "invalid_value")
    assert err["message"] == (
        "scheduler 'flow-euler' is not one tiny-image runs; it runs: ddim, pndm, euler, "
        "euler-a, dpm++2m, dpm++2m-karras, unipc, dpm++2m-sde, dpm++3m, pndm-prk, unipc-3"
    )
    with tiny.http() as http:
        r = http.post("/v1/videos", json={"prompt": "x", "scheduler": "ddim"})
        assert _error(r, 400, "scheduler", "invalid_value").startswith(
            "scheduler 'ddim' is not one tiny-video runs; it runs: unipc, flow-euler"
        )
    # one the model runs is taken, through the SDK's extra_body
    image = client.images.generate(
        prompt="red circle", extra_body={"scheduler": "dpm++2m-karras", "num_inference_steps": 3}
    )
    assert image.data[0].b64_json
