"""The server as a real process (`python -m vllm_omni_like.cli serve`), for kill/term tests."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import httpx
import psutil

from tests.api.conftest import free_port
from tests.conftest import mp_role


class ServeProcess:
    def __init__(
        self,
        args: list[str],
        storage: str,
        env: dict[str, str] | None = None,
        nofile: int | None = None,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.marker = uuid.uuid4().hex  # finds this server's processes, orphans included
        full_env = {**os.environ, "VLLM_OMNI_LIKE_TEST_MARKER": self.marker, **(env or {})}
        # the log goes to a file: a test can read it while the server runs
        self.log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - closed in cleanup()

        def limit() -> None:  # in the child, before exec: at most `nofile` descriptors
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm_omni_like.cli",
                "serve",
                *args,
                "--port",
                str(self.port),
                "--storage-dir",
                storage,
            ],
            env=full_env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=limit if nofile else None,
        )

    def wait_healthy(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError("server never became healthy")

    def wait_exit(self, timeout: float) -> int:
        """The server's exit code; one still running after `timeout` fails the test with every
        thread's stack of it and its workers (SIGUSR1: faulthandler) and the end of its log
        (a worker still starting, before its handler is set, dies of the signal)."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for p in [self.proc, *self.stage_workers()]:  # one at a time: no interleaving
                with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                    p.send_signal(signal.SIGUSR1)
                time.sleep(0.5)  # each writes its own dump
            raise AssertionError(
                f"the server did not exit within {timeout:g}s:\n{self.output()[-12000:]}"
            ) from None

    def output(self) -> str:
        """What the server printed so far."""
        if self.log.closed:
            return ""
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def processes(self) -> list[psutil.Process]:
        """Every live process carrying this server's marker (the server and its workers)."""
        found = []
        for p in psutil.process_iter():
            try:
                if (
                    p.environ().get("VLLM_OMNI_LIKE_TEST_MARKER") == self.marker
                    and p.status() != psutil.STATUS_ZOMBIE
                ):
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found

    def workers(self) -> list[psutil.Process]:
        """Every process of this server but itself: stage workers, multiprocessing's tracker."""
        return [p for p in self.processes() if p.pid != self.proc.pid]

    def stage_workers(self) -> list[psutil.Process]:
        """The stage workers only (spawned or forked), not multiprocessing's resource tracker or
        fork server."""
        found = []
        for p in self.workers():
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
                if mp_role(p) == "worker":
                    found.append(p)
        return found

    def cleanup(self) -> None:
        for p in self.processes():
            p.kill()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.log.close()
