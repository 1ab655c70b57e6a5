"""Starting `vllm-omni-like serve` as its own process for the benchmarks and drills."""

from __future__ import annotations

import base64
import contextlib
import io
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx
import numpy as np


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


# ---- what a benchmark reads from a running server ----------------------------------------------
def keep_timeline(directory: str, path: str) -> None:
    """Append the server's timeline (each set's marks, device and host clocks) to `path`."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as out:
        for name in sorted(os.listdir(directory)):
            if name.endswith("-timeline.jsonl"):
                with open(os.path.join(directory, name)) as f:
                    out.write(f.read())


PARTS = {  # the /metrics histograms of a request's parts
    "e2e_latency_seconds": "engine",  # the engine's end to end (before the API's encoding)
    "stage_latency_seconds": "worker",  # in the stage's worker
    "batch_phase_seconds": "",  # the worker's phases: denoise, finish (the decode)
}


def histograms(url: str) -> dict[str, tuple[float, float]]:
    """{part: (sum, count)} of the request parts' histograms, summed over their other labels."""
    out: dict[str, tuple[float, float]] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        for name, part in PARTS.items():
            for kind in ("_sum", "_count"):
                if name + kind not in line or line.startswith("#"):
                    continue
                labels, value = line.rsplit(" ", 1)
                key = part or labels.split('phase="')[1].split('"')[0]
                total, count = out.get(key, (0.0, 0.0))
                if kind == "_sum":
                    out[key] = (total + float(value), count)
                else:
                    out[key] = (total, count + float(value))
    return out


def png_bytes(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def pixels(r: httpx.Response) -> np.ndarray:
    from PIL import Image

    png = base64.b64decode(r.json()["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
