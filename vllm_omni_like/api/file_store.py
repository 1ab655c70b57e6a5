"""Generated image files behind unguessable, expiring URLs (response_format=url)."""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time

from vllm_omni_like.inputs import OmniRequest
from vllm_omni_like.stages.faults import FaultInjector


class FileStore:
    def __init__(self, directory: str, ttl_s: float, faults: FaultInjector | None = None) -> None:
        self.directory = directory
        self.ttl_s = ttl_s
        self.faults = faults  # point=store rules of stage=files
        self._expiry: dict[str, float] = {}
        self._lock = threading.Lock()
        os.makedirs(directory, exist_ok=True)
        for name in os.listdir(directory):  # nothing survives a restart: no expiry is known
            os.unlink(os.path.join(directory, name))

    def put(self, data: bytes, ext: str, request: OmniRequest | None = None) -> str:
        """Write the file (call in a thread); return its name, a random token."""
        if self.faults is not None and request is not None:
            self.faults.fire("store", [request])
        name = f"{secrets.token_urlsafe(24)}.{ext}"
        path = os.path.join(self.directory, name)
        try:
            with open(path, "wb") as f:
                f.write(data)
        except BaseException:
            with contextlib.suppress(OSError):  # no half-written file is left behind
                os.unlink(path)
            raise
        with self._lock:
            self._expiry[name] = time.monotonic() + self.ttl_s
        return name

    def path(self, name: str) -> str | None:
        with self._lock:
            expiry = self._expiry.get(name)
        if expiry is None or expiry < time.monotonic():
            return None
        return os.path.join(self.directory, name)

    def sweep(self) -> int:
        now = time.monotonic()
        with self._lock:
            gone = [n for n, t in self._expiry.items() if t < now]
            for name in gone:
                del self._expiry[name]
        for name in gone:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.directory, name))
        return len(gone)
