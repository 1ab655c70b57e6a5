"""Starting `vllm-omni-like serve` as its own process for the benchmarks and drills."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

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
