"""R11: no thread that owns deadlines, stall detection or health blocks on a worker's I/O: a
stopped worker with a large message on the way does not freeze the engine (real workers)."""

from __future__ import annotations

import io
import os
import signal
import threading
import time

import httpx
import numpy as np
from PIL import Image

from tests.api.conftest import live_server
from tests.conftest import wait_for
from tests.reliability.leaks import Baseline, check_engine


def _big_png() -> bytes:
    noise = np.random.default_rng(0).integers(0, 256, (1024, 1024, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, format="PNG", compress_level=0)
    return buf.getvalue()


def test_r11_a_stopped_worker_with_a_large_message_on_the_way(tmp_path_factory):
    base = Baseline()
    with live_server(
        tmp_path_factory,
        "null-image",
        stage_kw={"stall_timeout": 3.0, "cold_step_timeout": 3.0},
        engine_kw={"request_timeout": 20.0, "max_restarts": 2},
    ) as server:
        pool = server.engine.orchestrator.pools["null-image"][0]
        os.kill(pool.replicas[0].executor.pids[0], signal.SIGSTOP)
        results: dict[str, httpx.Response] = {}

        def edit() -> None:  # 4 MB to the stopped worker (image, mask, a long prompt): more
            # than a pipe holds
            mask = np.zeros((1024, 1024), np.uint8)
            mask[:, :512] = 255
            buf = io.BytesIO()
            Image.fromarray(mask).save(buf, format="PNG")
            results["edit"] = httpx.post(
                f"{server.url}/v1/images/edits",
                data={"prompt": "x " * 15_000, "model": "null-image", "num_inference_steps": "2"},
                files={
                    "image": ("big.png", _big_png(), "image/png"),
                    "mask": ("mask.png", buf.getvalue(), "image/png"),
                },
                timeout=30,
            )

        def later() -> None:
            results["later"] = httpx.post(
                f"{server.url}/v1/images/generations",
                json={"prompt": "y", "model": "null-image", "num_inference_steps": 2},
                timeout=30,
            )

        t0 = time.monotonic()
        threads = [threading.Thread(target=edit), threading.Thread(target=later)]
        threads[0].start()
        wait_for(lambda: pool.replicas[0].running, 5, "the edit dispatched to the stopped worker")
        threads[1].start()
        # the engine keeps answering while the send waits on the stopped worker's pipe
        health = httpx.get(f"{server.url}/health", timeout=1)
        assert health.status_code == 200
        wait_for(  # the stall detector still runs: the stopped worker is killed and restarted
            lambda: httpx.get(f"{server.url}/health", timeout=1).json()["status"] == "restarting",
            8,
            "the stall detector to kill the stopped worker",
        )
        for t in threads:
            t.join(30)
        assert results["edit"].status_code == 200, results["edit"].text  # re-run, same deadline
        assert results["later"].status_code == 200, results["later"].text
        assert results["edit"].json()["size"] == "1024x1024"
        assert time.monotonic() - t0 < 15
        wait_for(lambda: server.engine.stats.worker_deaths == 1, 5, "one death counted")
        check_engine(server)
    base.check(fd_slack=10)
