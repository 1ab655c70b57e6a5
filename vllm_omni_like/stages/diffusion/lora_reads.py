"""Adapter files read and checked on the host, off the worker's main thread: a request's
validation starts its adapters' reads (one thread; a file is read once while unchanged), and
its rows join the running set once they are done (running_set.py), so the rows already in the
set keep stepping meanwhile.

A read is keyed by the file's adapter, modification time and size: a file changed on disk is
read again for the next request that names it (and written again into the pool: lora_pool.py).
Its outcome, weights or the `LoraError` saying why the file cannot be used, is kept for the
twice the pool's slots most recently used files."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from vllm_omni_like.loras import LoraSpec
from vllm_omni_like.stages.diffusion.lora_files import AdapterWeights, LoraError

Key = tuple[LoraSpec, int, int]  # an adapter's file as it is now: (spec, mtime in ns, size)


def key_of(spec: LoraSpec) -> Key:
    """The file's key now (LoraError where it cannot be stat'ed)."""
    try:
        stat = os.stat(spec.path)
    except OSError as exc:
        raise LoraError(f"LoRA {spec.name!r}: {exc.strerror}: {spec.path}") from None
    return spec, stat.st_mtime_ns, stat.st_size


class LoraReads:
    def __init__(self, read: Callable[[LoraSpec], AdapterWeights], kept: int) -> None:
        self.read = read  # a file to checked weights (lora_files.read_adapter, bound)
        self.kept = kept
        self.lock = threading.Lock()
        self.done: OrderedDict[Key, AdapterWeights | LoraError] = OrderedDict()
        self.running: dict[Key, Future[Any]] = {}
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="lora-read")

    def start(self, key: Key) -> None:
        """`key`'s read on the read thread, unless it is done or under way."""
        with self.lock:
            if key in self.done or key in self.running:
                return
            self.running[key] = self.thread.submit(self._read, key)

    def ready(self, key: Key) -> bool:
        with self.lock:
            return key in self.done

    def result(self, key: Key) -> AdapterWeights:
        """`key`'s weights: its read's outcome (waited for, or read here where none was
        started); LoraError where the file cannot be used."""
        self.start(key)
        with self.lock:
            running = self.running.get(key)
        if running is not None:
            running.result()
        with self.lock:
            outcome = self.done.get(key)
        if outcome is None:  # (dropped from `done` by other reads since: read it here)
            self._read(key)
            with self.lock:
                outcome = self.done[key]
        with self.lock:
            self.done.move_to_end(key)
        if isinstance(outcome, LoraError):
            raise LoraError(str(outcome))
        return outcome

    def wait_any(self, keys: list[Key], timeout: float) -> None:
        """Until one of `keys`' reads is done, or `timeout` seconds passed."""
        with self.lock:
            running = [self.running[k] for k in keys if k in self.running]
        if running:
            wait(running, timeout, return_when=FIRST_COMPLETED)

    def close(self) -> None:
        """The read thread ends (a read under way ends first; none waiting starts)."""
        self.thread.shutdown(wait=False, cancel_futures=True)

    def _read(self, key: Key) -> None:
        spec = key[0]
        try:
            outcome: AdapterWeights | LoraError = self.read(spec)
        except LoraError as exc:
            outcome = exc
        except Exception as exc:  # (a malformed file: its metadata, alphas, a converter's error)
            outcome = LoraError(f"LoRA {spec.name!r}: unreadable ({type(exc).__name__}: {exc})")
        with self.lock:
            self.done[key] = outcome
            self.running.pop(key, None)
            while len(self.done) > self.kept:
                self.done.popitem(last=False)
