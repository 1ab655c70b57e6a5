"""The ids of the requests in the engine, and the successes whose output is still being stored.

Callers' threads submit (an id is claimed) and report stores; the orchestrator thread ends
requests. A request whose caller stores its output (`OmniRequest.stores_output`: a video job, a
url image, the offline command) has its success recorded only once the caller says the output
was written (`stored`), or its error if the write failed: every final status is recorded by the
orchestrator, in one place.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from vllm_omni_like.errors import ConflictError


@dataclass(frozen=True)
class Unstored:
    pipeline: str
    created: float  # when the request was made (its latency counts from here)
    ended: float  # when the engine ended it (a store not reported long after is lost)


class Ledger:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[str] = set()
        self._unstored: dict[str, Unstored] = {}

    def claim(self, request_id: str) -> None:
        """Raise ConflictError for an id already in the engine (a second request of one id
        would orphan the first one's state and its admission)."""
        with self._lock:
            if request_id in self._live or request_id in self._unstored:
                raise ConflictError(
                    f"request id {request_id!r} is already in the engine; ids must be unique",
                    code="duplicate_request_id",
                    param="request_id",
                )
            self._live.add(request_id)

    def release(self, request_id: str) -> None:
        """A claimed id that was not admitted after all."""
        with self._lock:
            self._live.discard(request_id)

    def ended(self, request_id: str, awaits_store: Unstored | None) -> None:
        """The request ended; a success whose output its caller stores waits for `stored`."""
        with self._lock:
            self._live.discard(request_id)
            if awaits_store is not None:
                self._unstored[request_id] = awaits_store

    def stored(self, request_id: str) -> Unstored | None:
        """The success awaiting this store (None: none awaits it, or it was reported)."""
        with self._lock:
            return self._unstored.pop(request_id, None)

    def overdue(self, now: float, after_s: float) -> list[str]:
        with self._lock:
            return [rid for rid, u in self._unstored.items() if now - u.ended > after_s]

    def __len__(self) -> int:
        with self._lock:
            return len(self._live) + len(self._unstored)
