"""Fault injection inside a stage, driven by the rules of VLLM_OMNI_LIKE_FAULTS."""

from __future__ import annotations

import errno
import hashlib
import os
import sys
import time
from collections.abc import Sequence
from typing import Protocol

from vllm_omni_like.config import FaultRule
from vllm_omni_like.errors import InvalidRequestError

SLOW_FAULT_S = 0.05  # what kind=slow costs each time it fires


class _HasPrompt(Protocol):
    request_id: str
    prompt: str


class InjectedFault(RuntimeError):
    """A recoverable failure put there on purpose (kind=raise)."""


class InjectedOutOfMemory(MemoryError):
    """An out-of-memory error put there on purpose (kind=oom)."""


def hash_fraction(seed: int, request_id: str, stage: str, point: str) -> float:
    """A stable number in [0, 1): the same request hits the same rule again on a re-run."""
    digest = hashlib.sha256(f"{seed}|{request_id}|{stage}|{point}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def selects(rule: FaultRule, request: _HasPrompt) -> bool:
    if rule.match is not None and rule.match not in request.prompt:
        return False
    if rule.p is not None:  # by the client's id where it gave one: drills can predict it
        key = getattr(request, "client_id", None) or request.request_id
        return hash_fraction(rule.seed, key, rule.stage, rule.point) < rule.p
    return True


class FaultInjector:
    """The rules of one stage; `fire` fails the call when a rule selects any request given."""

    def __init__(self, rules: Sequence[FaultRule], stage: str) -> None:
        self.stage = stage
        self.rules = [r for r in rules if r.stage == stage]
        self.fired: dict[str, int] = {}

    def fire(self, point: str, requests: Sequence[_HasPrompt]) -> None:
        for rule in self.rules:
            if rule.point != point:
                continue
            hit = [r for r in requests if selects(rule, r)]
            if hit:
                self._act(rule, point, hit[0].request_id)

    def fire_load(self) -> None:
        """Load has no request: a fraction selects this start (pid and clock), not a request."""
        for rule in self.rules:
            if rule.point != "load" or rule.match is not None:
                continue
            start = f"load-{os.getpid()}-{time.monotonic_ns()}"
            if rule.p is None or hash_fraction(rule.seed, start, self.stage, "load") < rule.p:
                self._act(rule, "load", None)

    def _act(self, rule: FaultRule, point: str, request_id: str | None) -> None:
        self.fired[rule.kind] = self.fired.get(rule.kind, 0) + 1
        # the monotonic clock is system-wide: a client on this host can time fault -> error
        where = (
            f"injected {rule.kind} fault at {point}"
            + (f" for request {request_id}" if request_id else "")
            + f" (t={time.monotonic():.3f})"
        )
        match rule.kind:
            case "raise":
                raise InjectedFault(where)
            case "enospc":
                raise OSError(errno.ENOSPC, f"No space left on device ({where})")
            case "invalid":
                raise InvalidRequestError(f"{where}: the request is invalid", stage=self.stage)
            case "oom":
                raise InjectedOutOfMemory(where)
            case "exit":
                sys.stderr.write(f"[{self.stage}] {where}: worker exits\n")
                sys.stderr.flush()
                os._exit(86)
            case "slow":  # a slow step, not a stuck one: drills of disconnects mid-generation
                time.sleep(SLOW_FAULT_S)
            case "hang":
                sys.stderr.write(f"[{self.stage}] {where}: worker hangs\n")
                sys.stderr.flush()
                while True:
                    time.sleep(3600)
