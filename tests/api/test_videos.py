"""/v1/videos through the openai SDK (multipart) and raw HTTP, on the null video pipeline."""

from __future__ import annotations

import time

import openai
import pytest

from tests.conftest import wait_until
from vllm_omni_like.video_codec import read_video


def test_create_and_poll_then_download(null_server, tmp_path):
    client = null_server.client()
    video = client.videos.create_and_poll(
        prompt="a square moving left", seconds="1", size="64x32", extra_body={"seed": 4, "fps": 8}
    )
    assert video.status == "completed" and video.progress == 100 and video.error is None
    assert video.size == "64x32" and video.seconds == "1.125"  # 8 frames rounded up to 9
    assert video.completed_at >= video.created_at and video.expires_at > video.completed_at
    content = client.videos.download_content(video.id)
    path = tmp_path / "clip.mp4"
    content.write_to_file(path)
    frames = read_video(str(path))
    assert frames.shape == (9, 32, 64, 3)
    data = path.read_bytes()
    assert data.index(b"moov") < data.index(b"mdat")  # faststart
    thumb = client.videos.download_content(video.id, variant="thumbnail")
    assert thumb.read()[:8] == b"\x89PNG\r\n\x1a\n"


def test_range_requests(null_server):
    video = null_server.client().videos.create_and_poll(prompt="x", seconds="1")
    with null_server.http() as http:
        whole = http.get(f"/v1/videos/{video.id}/content").content
        part = http.get(f"/v1/videos/{video.id}/content", headers={"range": "bytes=10-99"})
    assert part.status_code == 206 and part.content == whole[10:100]
    assert part.headers["content-range"] == f"bytes 10-99/{len(whole)}"


def test_progress_takes_several_values_and_poll_hint(null_server):
    client = null_server.client()
    video = client.videos.create(
        prompt="slow @delay=0.03", seconds="1", extra_body={"num_inference_steps": 40}
    )
    seen = set()
    with null_server.http() as http:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            r = http.get(f"/v1/videos/{video.id}")
            obj = r.json()
            seen.add(obj["progress"])
            if obj["status"] == "completed":
                break
            assert r.headers["openai-poll-after-ms"] == "100"
            time.sleep(0.05)
    assert obj["status"] == "completed"
    assert len([p for p in seen if 0 < p < 100]) >= 3, seen


def test_failed_job_and_content_statuses(null_server):
    client = null_server.client()
    video = client.videos.create_and_poll(prompt="x @fail", seconds="1")
    assert video.status == "failed"
    assert video.error.code == "generation_failed" and "injected raise fault" in video.error.message
    with null_server.http() as http:
        r = http.get(f"/v1/videos/{video.id}/content")
        assert r.status_code == 422 and r.json()["error"]["code"] == "video_failed"
        slow = client.videos.create(
            prompt="slow @delay=0.05", seconds="1", extra_body={"num_inference_steps": 60}
        )
        r = http.get(f"/v1/videos/{slow.id}/content")
        assert r.status_code == 409 and r.json()["error"]["code"] == "video_not_ready"
        assert r.headers["x-should-retry"] == "false"
        client.videos.delete(slow.id)


def test_delete_cancels_a_running_job(null_server):
    client = null_server.client()
    engine = null_server.engine
    before = engine.stats.final["aborted"]
    video = client.videos.create(
        prompt="slow @delay=0.05", seconds="1", extra_body={"num_inference_steps": 200}
    )
    assert wait_until(lambda: client.videos.retrieve(video.id).status == "in_progress", 5)
    deleted = client.videos.delete(video.id)
    assert deleted.deleted and deleted.id == video.id and deleted.object == "video.deleted"
    assert wait_until(lambda: engine.stats.final["aborted"] == before + 1, 2)
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)


def test_idempotency_key_returns_the_same_job(null_server):
    client = null_server.client()
    headers = {"Idempotency-Key": "same-key-1"}
    a = client.videos.create(prompt="x", seconds="1", extra_headers=headers)
    b = client.videos.create(prompt="x", seconds="1", extra_headers=headers)
    assert a.id == b.id
    c = client.videos.create(prompt="x", seconds="1")
    assert c.id != a.id
    with null_server.http() as http:  # the same key with another body: never the first job
        r = http.post("/v1/videos", json={"prompt": "y", "seconds": "1"}, headers=headers)
    assert r.status_code == 409 and r.headers["x-should-retry"] == "false"
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("idempotency_key_reused", "Idempotency-Key")
    assert err["message"] == (
        f"Idempotency-Key 'same-key-1' was used for another request ({a.id}); "
        "use a new key for a new video"
    )


def test_list_pages_with_a_cursor(null_server):
    client = null_server.client()
    ids = [client.videos.create(prompt=f"list {i}", seconds="1").id for i in range(5)]
    with null_server.http() as http:
        page = http.get("/v1/videos", params={"limit": 2, "order": "asc"}).json()
        assert page["object"] == "list" and len(page["data"]) == 2 and page["has_more"] is True
        collected, after = [], None
        while True:
            params = {"limit": 2, "order": "desc", **({"after": after} if after else {})}
            page = http.get("/v1/videos", params=params).json()
            collected += [v["id"] for v in page["data"]]
            if not page["has_more"]:
                break
            after = page["last_id"]
    assert collected[:5] == ids[::-1]  # newest first
    assert len(collected) == len(set(collected))
    sdk_ids = [v.id for v in client.videos.list(limit=2)]  # the SDK pages on its own
    assert sdk_ids[:5] == ids[::-1]


def test_bad_video_requests(null_server):
    with null_server.http() as http:
        r = http.post("/v1/videos", json={"prompt": "x", "seconds": "-3"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seconds"
        r = http.post("/v1/videos", data={"prompt": "x", "size": "99999x64"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "size"
        r = http.post("/v1/videos", json={"prompt": "x", "model": "null-image"})
        assert r.status_code == 400 and "makes images, not videos" in r.json()["error"]["message"]


def test_finished_files_expire(null_server):
    import asyncio
    import os

    service = null_server.app.state.server.videos
    video = null_server.client().videos.create_and_poll(prompt="expiring", seconds="1")
    row = service.store.get(video.id)
    assert os.path.exists(row["file"]) and os.path.exists(row["thumbnail"])
    service.store.update(video.id, expires_at=int(time.time()) - 1)
    expired = service.store.expired(int(time.time()))
    assert [r["id"] for r in expired] == [video.id]
    asyncio.run(asyncio.to_thread(service._remove, expired[0]))
    assert not os.path.exists(row["file"]) and not os.path.exists(row["thumbnail"])
    with pytest.raises(openai.NotFoundError):
        null_server.client().videos.retrieve(video.id)
