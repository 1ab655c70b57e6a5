"""R14: the engine keys requests on ids it owns; a client's repeated x-request-id never hangs,
merges with, overwrites or aborts another request (real server, real workers)."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx

from tests.api.conftest import live_server
from tests.reliability.leaks import Baseline, check_engine

SLOW = {"model": "null-image", "num_inference_steps": 20}  # 20 steps x 0.05 s


def _body(prompt: str, **kw) -> dict:
    return {"prompt": f"{prompt} @delay=0.05", "seed": 1, **SLOW, **kw}


def test_r14_two_requests_with_one_x_request_id_are_both_answered(tmp_path_factory):
    base = Baseline()
    with live_server(
        tmp_path_factory,
        "null-image",
        engine_kw={"request_timeout": 8.0, "max_queue_size": 4},
    ) as server:
        stats = server.engine.stats
        before = stats.snapshot()

        async def run():
            async with httpx.AsyncClient(base_url=server.url, timeout=20) as http:
                headers = {"x-request-id": "dup"}
                first = asyncio.create_task(
                    http.post("/v1/images/generations", json=_body("first"), headers=headers)
                )
                await asyncio.sleep(0.3)
                second = http.post("/v1/images/generations", json=_body("second"), headers=headers)
                t0 = time.monotonic()
                results = await asyncio.gather(first, second)
                return results, time.monotonic() - t0

        (a, b), took = asyncio.run(run())
        assert (a.status_code, b.status_code) == (200, 200), (a.text, b.text)
        assert a.headers["x-request-id"] == b.headers["x-request-id"] == "dup"
        assert a.json()["data"][0]["b64_json"] != b.json()["data"][0]["b64_json"]  # each its own
        assert took < 4  # two 1 s requests, not a deadline waited out
        snap = stats.snapshot()
        assert snap["requests_total"] - before["requests_total"] == 2
        assert snap["final"]["success"] - before["final"]["success"] == 2
        # no admission slot was lost: the whole queue (4) is still there
        with httpx.Client(base_url=server.url, timeout=20) as http:

            async def four():
                async with httpx.AsyncClient(base_url=server.url, timeout=20) as ahttp:
                    return await asyncio.gather(
                        *(
                            ahttp.post(
                                "/v1/images/generations",
                                json=_body(f"q{i}", num_inference_steps=4),
                                headers={"x-request-id": "dup"},
                            )
                            for i in range(4)
                        )
                    )

            assert [r.status_code for r in asyncio.run(four())] == [200] * 4
            assert http.get("/health").status_code == 200
        check_engine(server)
    base.check(fd_slack=10)


def test_r14_a_dropped_request_id_reused_at_once_is_not_aborted(tmp_path_factory):
    base = Baseline()
    with live_server(tmp_path_factory, "null-image", engine_kw={"request_timeout": 8.0}) as server:
        headers = {"x-request-id": "again"}
        for attempt in range(5):  # the drop lands at several points of the first request
            leave = 0.15 + 0.2 * attempt
            # the client gives up (its connection closes) while the request runs
            with contextlib.suppress(httpx.ReadTimeout):
                httpx.post(
                    f"{server.url}/v1/images/generations",
                    json=_body(f"dropped {attempt}", num_inference_steps=4 + 4 * attempt),
                    headers=headers,
                    timeout=leave,
                )
            t0 = time.monotonic()
            r = httpx.post(
                f"{server.url}/v1/images/generations",
                json=_body(f"reused {attempt}", num_inference_steps=4),
                headers=headers,
                timeout=20,
            )
            assert r.status_code == 200, r.text
            assert time.monotonic() - t0 < 2.0  # not its deadline (8 s) waited out
        check_engine(server)
    base.check(fd_slack=10)
