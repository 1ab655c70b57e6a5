"""A worker process's own life, however it started (executor/start_method.py): the name it
shows, the engine process it watches, and, when it was forked by the fork server, the engine's
environment and output streams of its start (a spawned worker inherits both; a forked one
would otherwise keep the fork server's, those of the fork server's own start)."""

from __future__ import annotations

import contextlib
import gc
import os
import select
import sys
import time
from multiprocessing import reduction
from typing import Any

PARENT_POLL_S = 0.2
WORKER_NAME = "omni-worker"  # the process name of every worker (/proc/<pid>/comm)


class EngineFd:
    """One of the engine's file descriptors, handed to the worker as it starts (pickled in the
    start's context: the fork server's child receives its own copy)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        return _received, (reduction.DupFd(self.fd),)


def _received(dup: Any) -> int:
    return int(dup.detach())


def engine_streams() -> tuple[EngineFd, EngineFd]:
    """The engine's descriptors 1 and 2 now (what a spawned worker inherits), for a worker of
    the fork server."""
    return EngineFd(1), EngineFd(2)


def adopt(environ: dict[str, str] | None, streams: tuple[int, int] | None) -> None:
    """Take the engine's environment and output streams of this start (a forked worker)."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    if streams is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, target in zip(streams, (1, 2), strict=True):
            os.dup2(fd, target)
            os.close(fd)


def name_process() -> None:
    """This process is `omni-worker` to ps and top (a worker of the fork server would otherwise
    carry the fork server's command line, and tell itself from it by nothing)."""
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as f:
        f.write(WORKER_NAME)


def watch_engine(engine_pid: int) -> None:
    """Exit as soon as the engine process is gone (even SIGKILLed): no orphans. The engine's
    pidfd wakes this thread when it exits (a worker of the fork server is not the engine's
    child); where the kernel has none, poll."""
    try:
        fd = os.pidfd_open(engine_pid)
    except ProcessLookupError:
        os._exit(0)
    except OSError:  # no pidfds here
        fd = -1
    if fd >= 0:
        select.select([fd], [], [])
        os._exit(0)
    while os.getppid() == engine_pid or _alive(engine_pid):
        time.sleep(PARENT_POLL_S)
    os._exit(0)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def freeze_heap() -> None:
    """After the load (a compiled model's warm-up included): what the worker keeps for good
    (the modules, a compiled model's graphs and guards: about a million Python objects for the
    tiny compiled FLUX.1) moves out of the garbage collector's reach. A full collection walks
    every tracked object - 0.78 s over that heap on the 2-core CPU - and would come on some
    request's path as a stall. Garbage is collected first, so only what lives on is frozen."""
    gc.collect()
    gc.freeze()
