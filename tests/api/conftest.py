"""Real uvicorn servers on 127.0.0.1 (in a thread of the test process), shared per module."""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from vllm_omni_like.api.app import create_app
from vllm_omni_like.api.http_server import build_server
from vllm_omni_like.config import EngineConfig, Limits, ServerSettings, parse_faults
from vllm_omni_like.engine import AsyncOmni
from vllm_omni_like.pipelines.catalog import resolve

FAULTS = (
    "stage=diffusion,point=execute,kind=raise,match=@fail;"
    "stage=diffusion,point=step,kind=invalid,match=@invalid"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(
        self,
        specs: tuple[str, ...],
        storage: str,
        faults: str = "",
        stage_kw: dict | None = None,
        engine_kw: dict | None = None,
        settings_kw: dict | None = None,
    ) -> None:
        pipelines = tuple(p for spec in specs for p in resolve(spec, **(stage_kw or {})))
        self.engine = AsyncOmni(
            EngineConfig(pipelines=pipelines, faults=parse_faults(faults), **(engine_kw or {}))
        )
        self.port = free_port()
        self.settings = ServerSettings(
            host="127.0.0.1", port=self.port, storage_dir=storage, **(settings_kw or {})
        )
        self.fatal: list[str] = []
        self.app = create_app(self.engine, self.settings, self.fatal.append)
        self.server = build_server(self.app, self.settings, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self, ready: bool = True) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.server.started and (not ready or self.engine.started or self.fatal):
                time.sleep(0.1)
                loop = self.app.state.loop
                self.idle_tasks = len([t for t in asyncio.all_tasks(loop) if not t.done()])
                return self
            time.sleep(0.02)
        raise AssertionError("server did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        if self.thread.is_alive():  # what it still waits for, and every thread's stack
            faulthandler.dump_traceback(all_threads=True)
            state = self.server.server_state
            raise AssertionError(
                f"the server did not stop in 30 s: {len(state.connections)} connections "
                f"{[vars(c).get('client') for c in list(state.connections)]}, "
                f"tasks {[t.get_coro() for t in list(state.tasks)]}"
            )

    def client(self, **kw):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.url}/v1", api_key=kw.pop("api_key", "test"), **kw)

    def http(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", 30), **kw)


def run_example(name: str, server: LiveServer, cwd) -> list[str]:
    """Run examples/<name> against `server` with warnings as errors, in `cwd`; its stdout
    lines (it must exit 0 and write nothing to stderr)."""
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", name)
    out = subprocess.run(
        [sys.executable, "-W", "error", example],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
        env={**os.environ, "OPENAI_BASE_URL": f"{server.url}/v1", "OPENAI_API_KEY": "k"},
    )
    assert out.returncode == 0 and out.stderr == "", out.stderr
    return out.stdout.splitlines()


@contextlib.contextmanager
def live_server(tmp_path_factory, *specs: str, **kw):
    server = LiveServer(specs, str(tmp_path_factory.mktemp("storage")), **kw).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def null_server(tmp_path_factory):
    limits = Limits(max_body_bytes=2_000_000, max_upload_bytes=300_000)
    with live_server(
        tmp_path_factory,
        "null-omni",
        "null-image",
        "null-video",
        faults=FAULTS,
        engine_kw={"request_timeout": 3.0},
        settings_kw={"limits": limits, "keepalive_s": 0.2},
    ) as server:
        yield server
