"""Image to video through /v1/videos (`input_reference`, a multipart file) on tiny real models:
Wan2.2-TI2V's shape (text or a first frame) and an image-to-video-only model (Wan2.2-I2V-A14B's
shape). The openai SDK's upload, the size taken from the image's aspect, the 400s (a text-only
model, no image for an image-only one, JSON, not an image, too large), an idempotent retry with
another image, and the image kept with a queued job across a restart and gone once it ends."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from PIL import Image

from tests.api.conftest import LiveServer, live_server
from tests.conftest import wait_until
from tests.models.tiny_wan22 import tiny_wan22_i2v_experts_path, tiny_wan22_ti2v_path
from vllm_omni_like.config import Limits
from vllm_omni_like.video_codec import read_video

pytestmark = pytest.mark.slow
FAST = {"num_inference_steps": 2, "num_frames": 5, "seed": 1}
SMALL = {"options": {"default_size": 64}}  # (a tiny directory's default would be 512)


def png(width: int, height: int, shade: int = 0) -> bytes:
    yy, xx = np.mgrid[0:height, 0:width]
    rgb = np.stack([xx * 255 // width, yy * 255 // height, np.full_like(xx, shade)], -1)
    buf = io.BytesIO()
    Image.fromarray(rgb.astype(np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    ti2v, i2v = tiny_wan22_ti2v_path(), tiny_wan22_i2v_experts_path()
    limits = Limits(max_upload_bytes=200_000)
    with live_server(
        tmp_path_factory, ti2v, i2v, "tiny-video", settings_kw={"limits": limits}, stage_kw=SMALL
    ) as server:
        server.ti2v, server.i2v = os.path.basename(ti2v), os.path.basename(i2v)
        yield server


def _inputs(server) -> list[str]:
    media = server.app.state.server.videos.store.media_dir
    return sorted(n for n in os.listdir(media) if n.endswith(".input.png"))


def test_a_first_frame_through_the_openai_sdk_makes_a_video_at_its_aspect(servers, tmp_path):
    client = servers.client()
    video = client.videos.create_and_poll(
        model=servers.ti2v,
        prompt="a gradient comes alive",
        input_reference=("first.png", png(128, 64), "image/png"),
        extra_body=FAST,
        poll_interval_ms=100,
    )
    assert video.status == "completed", video.error
    assert video.size == "96x48"  # 2:1 at the model's default 64x64 area, in 16s
    path = tmp_path / "v.mp4"
    client.videos.download_content(video.id).write_to_file(path)
    assert read_video(str(path)).shape == (5, 48, 96, 3)
    assert wait_until(lambda: not _inputs(servers), 10)  # the kept image went with the job


def test_a_size_given_is_made_and_the_image_only_model_takes_one_too(servers):
    client = servers.client()
    for model in (servers.ti2v, servers.i2v):
        video = client.videos.create_and_poll(
            model=model,
            prompt="x",
            size="64x32",
            input_reference=("f.png", png(40, 40), "image/png"),
            extra_body={**FAST, "guidance_scale_2": 2.0} if model == servers.i2v else FAST,
            poll_interval_ms=100,
        )
        assert video.status == "completed" and video.size == "64x32", (model, video.error)


@pytest.mark.parametrize(
    ("model", "send", "status", "says"),
    [
        ("tiny-video", "png", 400, "makes videos from text only"),
        ("i2v", None, 400, "send one as input_reference"),
        ("ti2v", "text", 400, "not a readable image"),
        ("ti2v", "bmp", 400, "must be PNG, JPEG or WebP"),
        ("ti2v", "big", 413, "over the limit of 200000 bytes"),
    ],
)
def test_what_is_refused_at_create(servers, model, send, status, says):
    model = {"i2v": servers.i2v, "ti2v": servers.ti2v}.get(model, model)
    files = {
        "png": ("f.png", png(32, 32), "image/png"),
        "text": ("f.png", b"not an image", "image/png"),
        "bmp": ("f.bmp", _encoded("BMP", np.zeros((8, 8, 3), np.uint8)), "image/bmp"),
        "big": (
            "f.png",
            _encoded("PNG", np.random.default_rng(0).integers(0, 255, (300, 300, 3))),
            "image/png",
        ),
    }
    upload = {"input_reference": files[send]} if send else None
    with servers.http() as http:
        r = http.post("/v1/videos", data={"model": model, "prompt": "x"}, files=upload)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == "input_reference" and says in error["message"], error
    if send is None:
        assert error["code"] == "image_required"
    assert not _inputs(servers)


def _encoded(fmt: str, pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def test_models_say_which_take_an_image(servers):
    client = servers.client()
    says = {}
    for model in (servers.ti2v, servers.i2v, "tiny-video"):
        limits = client.models.retrieve(model).model_dump()["limits"]
        says[model] = (limits["image_to_video"], limits["needs_image"])
    assert says == {
        servers.ti2v: (True, False),  # text or a first frame
        servers.i2v: (True, True),  # a first frame always
        "tiny-video": (False, False),
    }


def test_json_cannot_carry_an_image(servers):
    with servers.http() as http:
        r = http.post(
            "/v1/videos",
            json={
                "model": servers.ti2v,
                "prompt": "x",
                "input_reference": "data:image/png;base64,",
            },
        )
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "input_reference"
    assert "multipart/form-data" in r.json()["error"]["message"]


def test_an_idempotent_retry_must_send_the_same_image(servers):
    form = {
        "model": servers.ti2v,
        "prompt": "x",
        "size": "32x32",
        **{k: str(v) for k, v in FAST.items()},
    }
    key = {"idempotency-key": "i2v-retry"}
    with servers.http() as http:
        first = http.post(
            "/v1/videos",
            data=form,
            headers=key,
            files={"input_reference": ("a.png", png(32, 32), "image/png")},
        )
        again = http.post(
            "/v1/videos",
            data=form,
            headers=key,
            files={"input_reference": ("a.png", png(32, 32), "image/png")},
        )
        other = http.post(
            "/v1/videos",
            data=form,
            headers=key,
            files={"input_reference": ("b.png", png(32, 32, 200), "image/png")},
        )
        assert first.status_code == 200 and again.json()["id"] == first.json()["id"]
        assert (
            other.status_code == 409 and other.json()["error"]["code"] == "idempotency_key_reused"
        )
        video_id = first.json()["id"]
        assert wait_until(
            lambda: http.get(f"/v1/videos/{video_id}").json()["status"] == "completed", 30
        )
    assert wait_until(lambda: not _inputs(servers), 10)  # neither retry left an image behind


def test_a_queued_job_keeps_its_image_across_a_restart(tmp_path_factory):
    """Two jobs queued by a server that cannot run them; one's image removed by hand while it
    is down: the next server makes the other's video and fails that one with a clear error."""
    storage = str(tmp_path_factory.mktemp("i2v-restart"))
    ti2v = tiny_wan22_ti2v_path()
    name = os.path.basename(ti2v)
    first = LiveServer(
        (ti2v,), storage, settings_kw={"video_concurrency": 0}, stage_kw=SMALL
    ).start()
    try:  # (no room for a running job: they stay queued)
        kept, lost = (
            first.client().videos.create(
                model=name,
                prompt="x",
                size="32x32",
                input_reference=("a.png", png(32, 32, shade), "image/png"),
                extra_body=FAST,
            )
            for shade in (0, 99)
        )
        assert kept.status == lost.status == "queued"
        assert _inputs(first) == sorted(f"{v.id}.input.png" for v in (kept, lost))
        media = first.app.state.server.videos.store.media_dir
    finally:
        first.stop()
    os.unlink(os.path.join(media, f"{lost.id}.input.png"))
    second = LiveServer((ti2v,), storage, stage_kw=SMALL).start()
    try:
        client = second.client()
        assert wait_until(lambda: client.videos.retrieve(kept.id).status == "completed", 60)
        assert wait_until(lambda: client.videos.retrieve(lost.id).status == "failed", 30)
        error = client.videos.retrieve(lost.id).error
        assert error.code == "input_reference_missing"
        assert error.message.startswith("the job's input_reference is gone from the storage dir")
        assert wait_until(lambda: not _inputs(second), 10)
    finally:
        second.stop()


def test_a_first_frame_of_any_aspect_gives_a_size_the_model_makes():
    """`fit_area`: the image's aspect at the model's default area, within its side limit, in
    its multiples - never below one multiple, whatever the aspect."""
    from vllm_omni_like.models.limits import ModelLimits
    from vllm_omni_like.protocol.admission import fit_area

    model = ModelLimits(
        output="video",
        max_side=1280,
        max_pixels=1280 * 1280,
        max_steps=50,
        default_steps=50,
        size_multiple=16,
        default_width=1280,
        default_height=720,
    )
    assert fit_area(1920, 1080, model) == (1280, 720)  # the model's own aspect
    assert fit_area(1080, 1920, model) == (720, 1280)  # portrait: the same area
    assert fit_area(1000, 1000, model) == (960, 960)  # 960^2 ~ 1280 x 720
    assert fit_area(4000, 100, model) == (1280, 32)  # capped by the side limit
    assert fit_area(100, 100_000, model) == (16, 1280)  # (never below one multiple)
    for size in ((1920, 1080), (333, 777), (4000, 100), (100, 100_000)):
        w, h = fit_area(*size, model)
        assert model.supports(w, h), (size, w, h)
