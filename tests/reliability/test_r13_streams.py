"""A stream that already sent partial images is never re-run after its worker dies: it ends with
one error event and [DONE] (real server, real workers, SIGKILL)."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx

from tests.api.conftest import live_server
from tests.conftest import wait_for
from tests.reliability.leaks import Baseline, check_engine


def test_a_stream_with_partial_images_sent_is_not_rerun_after_a_worker_death(tmp_path_factory):
    base = Baseline()
    with live_server(tmp_path_factory, "null-image", engine_kw={"max_restarts": 2}) as server:
        pool = server.engine.orchestrator.pools["null-image"][0]
        body = {
            "prompt": "x @delay=0.1",
            "model": "null-image",
            "num_inference_steps": 20,
            "stream": True,
            "partial_images": 2,
        }
        events: list[tuple[str | None, str]] = []
        with (
            httpx.Client(base_url=server.url, timeout=30) as http,
            http.stream("POST", "/v1/images/generations", json=body) as r,
        ):
            assert r.status_code == 200
            name = None
            for line in r.iter_lines():
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    events.append((name, line[6:]))
                    if name == "image_generation.partial_image" and len(events) == 1:
                        killed = time.monotonic()
                        os.kill(pool.replicas[0].executor.pids[0], signal.SIGKILL)
                    name = None
        assert time.monotonic() - killed < 5
        partials = [
            json.loads(d)["partial_image_index"] for n, d in events if "partial" in (n or "")
        ]
        assert partials == [0]  # not re-run: no second partial #0 (or #1) from a new run
        (name, data), done = events[-2], events[-1]
        assert name == "error" and done == (None, "[DONE]")
        err = json.loads(data)["error"]
        assert err["code"] == "generation_failed" and err["stage"] == "diffusion"
        assert err["message"].startswith("stage 'diffusion': worker ")
        assert err["message"].endswith(
            "after 1 partial image(s) were streamed; a stream is not re-run"
        )
        wait_for(lambda: pool.live_count == 1, 10, "the replica restarted")
        check_engine(server)
    base.check(fd_slack=10)
