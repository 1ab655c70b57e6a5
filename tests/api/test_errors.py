"""Every status and retry header of API.md, produced and its body asserted (raw HTTP)."""

from __future__ import annotations

import asyncio
import gc
import io
import logging
import os
import signal
import threading
import time

import httpx
import pytest
from PIL import Image

from tests.api.conftest import live_server
from tests.conftest import wait_for, wait_until
from vllm_omni_like.engine import stage_pool


def _err(r: httpx.Response, status: int, code: str, etype: str = "invalid_request_error"):
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["code"] == code and body["type"] == etype
    assert body["message"] and body["request_id"] == r.headers["x-request-id"]
    return body


def test_400_validation_names_the_field(null_server):
    with null_server.http() as http:
        body = _err(
            http.post("/v1/images/generations", json={"prompt": "x", "n": 11}),
            400,
            "invalid_request",
        )
        assert body["param"] == "n" and "less than or equal to 10" in body["message"]
        body = _err(
            http.post("/v1/images/generations", json={"prompt": "x", "colour": "red"}),
            400,
            "invalid_request",
        )
        assert body["param"] == "colour"
        body = _err(http.post("/v1/images/generations", json={}), 400, "invalid_request")
        assert body["param"] == "prompt"
        r = http.post(
            "/v1/images/generations",
            json={"prompt": "x", "quality": "hd", "style": "vivid", "model": "null-image"},
        )
        assert r.status_code == 200  # known OpenAI fields are accepted and ignored


def test_400_from_inside_a_stage_names_the_stage(null_server):
    with null_server.http() as http:
        body = _err(
            http.post(
                "/v1/images/generations", json={"prompt": "x @invalid", "model": "null-image"}
            ),
            400,
            "invalid_request",
        )
    assert body["stage"] == "diffusion" and body["message"].startswith("stage 'diffusion':")


def test_404_unknown_model_and_route_and_video(null_server):
    with null_server.http() as http:
        _err(
            http.post("/v1/images/generations", json={"prompt": "x", "model": "nope"}),
            404,
            "model_not_found",
        )
        _err(http.get("/v1/videos/video_nope"), 404, "video_not_found")
        _err(http.get("/v1/nothing-here"), 404, "not_found")


def test_405_a_route_asked_with_the_wrong_method(null_server):
    with null_server.http() as http:
        body = _err(http.get("/v1/images/generations"), 405, "method_not_allowed")
        assert body["message"] == "GET is not allowed on /v1/images/generations"


def test_413_body_and_upload_limits(null_server):
    with null_server.http() as http:
        _err(
            http.post(
                "/v1/images/generations",
                content=b"x" * 2_100_000,
                headers={"content-type": "application/json"},
            ),
            413,
            "payload_too_large",
        )
        big = os.urandom(400_000)
        r = http.post(
            "/v1/images/edits",
            files={"image": ("a.png", big, "image/png")},
            data={"prompt": "x", "model": "null-image"},
        )
        body = _err(r, 413, "payload_too_large")
        assert body["param"] == "image"
        # the size sent, never the read cap (300001) as if it were the upload's size
        assert body["message"] == "image is 400000 bytes, over the limit of 300000 bytes"
        bad = http.post(
            "/v1/images/edits",
            files={"image": ("a.png", b"not an image", "image/png")},
            data={"prompt": "x", "model": "null-image"},
        )
        body = _err(bad, 400, "invalid_image")
        assert body["param"] == "image"
        assert body["message"] == "image is not a readable image: not a PNG, JPEG or WebP file"
        png = io.BytesIO()
        Image.new("RGB", (64, 64), (255, 0, 0)).save(png, "PNG")
        cut = http.post(  # a PNG whose end is missing: PIL's own words, no object repr
            "/v1/images/edits",
            files={"image": ("a.png", png.getvalue()[:-40], "image/png")},
            data={"prompt": "x", "model": "null-image"},
        )
        message = _err(cut, 400, "invalid_image")["message"]
        assert (
            message.startswith("image is not a readable image: ") and "object at 0x" not in message
        )


def test_a_truncated_multipart_body_is_named_so(null_server):
    png = io.BytesIO()
    Image.new("RGB", (64, 64), (255, 0, 0)).save(png, "PNG")
    whole = httpx.Request(
        "POST",
        f"{null_server.url}/v1/images/edits",
        files={"image": ("a.png", png.getvalue(), "image/png")},
        data={"prompt": "x", "model": "null-image"},
    )
    body, kind = whole.read(), whole.headers["content-type"]
    with null_server.http() as http:
        for size in (len(body) - 10, len(body) // 2):
            r = http.post("/v1/images/edits", content=body[:size], headers={"content-type": kind})
            assert _err(r, 400, "invalid_multipart")["message"] == (
                f"the multipart body is truncated: its {size} bytes end before the closing boundary"
            )
        assert (
            http.post("/v1/images/edits", content=body, headers={"content-type": kind}).status_code
            == 200
        )


def test_500_carries_no_retry_and_names_the_stage(null_server):
    with null_server.http() as http:
        r = http.post("/v1/images/generations", json={"prompt": "x @fail", "model": "null-omni"})
    body = _err(r, 500, "generation_failed", "server_error")
    assert r.headers["x-should-retry"] == "false"
    assert body["stage"] == "diffusion"
    assert body["message"].startswith(
        "stage 'diffusion': InjectedFault: injected raise fault at "
        f"execute for request {r.headers['x-request-id']} (t="
    )


def test_504_when_the_deadline_passes(null_server):
    t0 = time.monotonic()
    with null_server.http() as http:
        r = http.post(
            "/v1/images/generations",
            json={"prompt": "x @delay=0.1", "model": "null-image", "num_inference_steps": 100},
        )
    assert time.monotonic() - t0 < 6
    body = _err(r, 504, "timeout", "timeout_error")
    assert r.headers["x-should-retry"] == "false"
    assert "deadline of 3.0s passed" in body["message"]


def test_request_id_is_echoed(null_server):
    with null_server.http() as http:
        r = http.get("/v1/models", headers={"x-request-id": "mine-123"})
    assert r.headers["x-request-id"] == "mine-123"
    assert [m["id"] for m in r.json()["data"]] == ["null-omni", "null-image", "null-video"]


def test_client_disconnect_aborts_the_request(null_server, caplog):
    stats = null_server.engine.stats
    before = stats.final["aborted"]
    caplog.set_level(logging.ERROR, logger="asyncio")
    # last: set_level sets caplog's handler level too, and INFO must reach it
    caplog.set_level(logging.INFO, logger="vllm_omni_like.api.errors")
    with pytest.raises(httpx.ReadTimeout), null_server.http(timeout=0.3) as http:
        http.post(
            "/v1/images/generations",
            json={"prompt": "x @delay=0.05", "model": "null-image", "num_inference_steps": 50},
        )
    wait_for(lambda: stats.final["aborted"] == before + 1, 2, "the abort is counted")
    wait_for(lambda: not null_server.engine.orchestrator.requests, 2, "no request state left")
    wait_for(
        lambda: any("the client disconnected" in r.getMessage() for r in caplog.records),
        2,
        "the disconnect is logged as such",
    )
    assert not any("-> 500" in r.getMessage() for r in caplog.records)
    gc.collect()  # a future nobody read logs "exception was never retrieved" when collected
    assert not any("never retrieved" in r.getMessage() for r in caplog.records), caplog.text


def test_invalid_json_says_what_is_wrong_and_where(null_server):
    with null_server.http() as http:
        r = http.post(
            "/v1/images/generations",
            content=b'{"prompt": "x",}',
            headers={"content-type": "application/json"},
        )
    body = _err(r, 400, "invalid_request")
    assert body["param"] is None
    assert body["message"] == (
        "the request body is not valid JSON: Expecting property name enclosed in double quotes "
        "at character 15"
    )


def test_a_chunked_body_over_the_limit_is_a_413(null_server):
    def chunks():
        for _ in range(22):  # 2.2 MB against the 2 MB limit, without a Content-Length
            yield b"x" * 100_000

    with null_server.http() as http:
        r = http.post(
            "/v1/images/generations",
            content=chunks(),
            headers={"content-type": "application/json"},
        )
        assert "content-length" not in r.request.headers
        body = _err(r, 413, "payload_too_large")
        assert body["message"] == "request body is over the limit of 2000000 bytes"
        small = http.post(
            "/v1/images/generations",
            content=iter([b'{"prompt": "x", ', b'"model": "null-image"}']),
            headers={"content-type": "application/json"},
        )
        assert small.status_code == 200, small.text  # a chunked body under the limit is read


def test_401_without_or_with_a_wrong_key(tmp_path_factory):
    with (
        live_server(
            tmp_path_factory, "null-image", settings_kw={"api_keys": ("k1", "k2")}
        ) as server,
        server.http() as http,
    ):
        for headers in ({}, {"authorization": "Bearer wrong"}):
            r = http.post("/v1/images/generations", json={"prompt": "x"}, headers=headers)
            _err(r, 401, "invalid_api_key")
        ok = http.post(
            "/v1/images/generations", json={"prompt": "x"}, headers={"authorization": "Bearer k2"}
        )
        assert ok.status_code == 200
        assert http.get("/health").status_code == 200  # probes never need the key
        assert http.get("/metrics").status_code == 200
        assert server.client(api_key="k1").images.generate(prompt="x").data


def test_429_when_the_queue_is_full(tmp_path_factory):
    with live_server(tmp_path_factory, "null-image", engine_kw={"max_queue_size": 2}) as server:

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                slow = [
                    asyncio.create_task(
                        http.post(
                            "/v1/images/generations",
                            json={"prompt": "x @delay=0.05", "num_inference_steps": 10},
                        )
                    )
                    for _ in range(2)
                ]
                await asyncio.sleep(0.2)
                third = await http.post("/v1/images/generations", json={"prompt": "x"})
                return third, await asyncio.gather(*slow)

        third, slow = asyncio.run(run())
        _err(third, 429, "queue_full", "rate_limit_error")
        assert third.headers["retry-after"] == "1"
        assert [r.status_code for r in slow] == [200, 200]


def _kill_only_worker(server):
    pool = server.engine.orchestrator.pools["null-image"][0]
    os.kill(pool.replicas[0].executor.pids[0], signal.SIGKILL)


def test_503_dead_health_and_requests_when_no_restart_is_left(tmp_path_factory):
    with (
        live_server(tmp_path_factory, "null-image", engine_kw={"max_restarts": 0}) as server,
        server.http() as http,
    ):
        results = []
        slow = threading.Thread(
            target=lambda: results.append(
                http.post(
                    "/v1/images/generations",
                    json={"prompt": "x @delay=0.05", "num_inference_steps": 100},
                )
            )
        )
        slow.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        _kill_only_worker(server)
        assert wait_until(lambda: http.get("/health").status_code == 503, 2)
        assert time.monotonic() - t0 < 2
        slow.join(5)
        body = _err(results[0], 503, "engine_dead", "service_unavailable")
        assert results[0].headers["x-should-retry"] == "false" and body["stage"] == "diffusion"
        health = http.get("/health").json()
        assert health["status"] == "dead" and health["stages"][0]["replicas_live"] == 0
        t1 = time.monotonic()
        late = http.post("/v1/images/generations", json={"prompt": "x"})
        assert time.monotonic() - t1 < 0.5
        _err(late, 503, "engine_dead", "service_unavailable")


def test_503_restarting_then_healthy_again(tmp_path_factory, monkeypatch):
    monkeypatch.setattr(stage_pool, "RESTART_BACKOFF_S", (1.5,))  # a window to look through
    with (
        live_server(tmp_path_factory, "null-image", engine_kw={"max_restarts": 1}) as server,
        server.http() as http,
    ):
        _kill_only_worker(server)
        assert wait_until(lambda: http.get("/health").json()["status"] == "restarting", 2)
        r = http.get("/health")
        assert r.status_code == 503 and r.json()["stages"][0]["state"] == "restarting"
        refused = http.post("/v1/images/generations", json={"prompt": "x"})
        body = _err(refused, 503, "restarting", "service_unavailable")
        assert refused.headers["retry-after"] == "2" and body["stage"] == "diffusion"
        assert "x-should-retry" not in refused.headers
        assert wait_until(lambda: http.get("/health").status_code == 200, 10)
        assert http.post("/v1/images/generations", json={"prompt": "x"}).status_code == 200


def test_a_header_that_is_not_utf8_is_no_500(null_server):
    import socket

    for path in ("/health", "/v1/models"):
        with socket.create_connection(("127.0.0.1", null_server.port), timeout=5) as sock:
            sock.sendall(
                f"GET {path} HTTP/1.1\r\nHost: x\r\nX-Note: caf\xe9 \xff\r\n"
                "Connection: close\r\n\r\n".encode("latin-1")
            )
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").lower()
        assert head.startswith("http/1.1 200"), head
        assert "x-request-id: req_" in head


def test_an_empty_api_key_is_a_startup_error(tmp_path, capsys, monkeypatch):
    from vllm_omni_like.cli import main

    args = ["serve", "null-image", "--storage-dir", str(tmp_path), "--port", "1"]
    assert main([*args, "--api-key", ""]) == 2
    assert "an empty API key (--api-key '' or an empty entry in VLLM_OMNI_LIKE_API_KEY)" in (
        capsys.readouterr().err
    )
    monkeypatch.setenv("VLLM_OMNI_LIKE_API_KEY", "k1,,k2")
    assert main(args) == 2
    assert "would leave the server open" in capsys.readouterr().err
