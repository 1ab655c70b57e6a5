"""Starting `vllm-omni-like serve` as its own process for the benchmarks and drills."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(args: list[str], port: int, storage: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vllm_omni_like.cli",
        "serve",
        *args,
        "--port",
        str(port),
        "--storage-dir",
        storage,
    ]


def wait_healthy(proc: subprocess.Popen, port: int, timeout: float = 60) -> bool:
    """True once /health says 200; False if the process exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    return False


class Server:
    """`vllm-omni-like serve ...` as its own process; its log kept for the report."""

    def __init__(
        self,
        args: list[str],
        log_path: str,
        timeout: float,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "a")  # noqa: SIM115 - closed in stop()
        self.log.write(f"\n==== serve {' '.join(args)}\n")
        self.log.flush()
        cmd = serve_command(args, self.port, tempfile.mkdtemp(prefix="bench-"))
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=cwd
        )
        t0 = time.monotonic()
        if not wait_healthy(self.proc, self.port, timeout):
            self.stop()
            raise RuntimeError(f"server did not become healthy; see {log_path}")
        self.start_s = time.monotonic() - t0

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of the API process (HTTP, orchestrator, image encoding), of its
        workers (all its children now), and of this client process."""
        import psutil

        api = psutil.Process(self.proc.pid)
        workers = 0.0
        for child in api.children(recursive=True):
            with contextlib.suppress(psutil.Error):  # (one that ended meanwhile)
                workers += sum(child.cpu_times()[:2])
        return {"api": sum(api.cpu_times()[:2]), "workers": workers, "client": time.process_time()}

    def cpu_ms_per_image(self, before: dict[str, float], images: int) -> dict[str, float]:
        """What each part's CPU (`cpu_seconds`) cost an image since `before`."""
        now = self.cpu_seconds()
        return {k: round((now[k] - v) * 1000 / images, 1) for k, v in before.items()}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def make_video(http: Any, body: dict[str, Any]) -> bytes:
    """One video through `/v1/videos` as a client makes it: create, poll at 50 ms, content."""
    job = http.post("/v1/videos", json=body).json()
    while job["status"] in ("queued", "in_progress"):
        time.sleep(0.05)
        job = http.get(f"/v1/videos/{job['id']}").json()
    if job["status"] != "completed":
        raise RuntimeError(f"video failed: {job}")
    return bytes(http.get(f"/v1/videos/{job['id']}/content").content)
