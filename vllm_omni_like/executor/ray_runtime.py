"""The server's connection to Ray: joined once per process, on the first Ray executor's start.

`--ray-address` joins an existing cluster (`ray start --head` on one machine, `ray start
--address=HEAD:6379` on the others); without it a local Ray instance starts with the server
(dashboard off) and stops with it (`shutdown`, and Ray's own exit hook). The actors a server
creates are owned by it: when the server process dies, Ray ends them (owner fate-sharing).
"""

from __future__ import annotations

import signal
import threading
from typing import Any

_lock = threading.Lock()
_address: str | None = None
_worker_class: Any = None


def configure(address: str | None) -> None:
    """Where to connect (None: a local instance); before the first executor starts."""
    global _address
    _address = address


def ray_module() -> Any:
    """`ray`, connected.

    Connect from the main thread first (`factory_for` does, before the server starts): there
    the SIGTERM handling Ray installs is undone. Ray's driver registers SIGTERM with abseil's
    failure handler, which arms a 3 s abort: a server draining its requests after a SIGTERM
    would abort mid-drain and leave the local cluster behind."""
    import ray

    with _lock:
        if not ray.is_initialized():
            main = threading.current_thread() is threading.main_thread()
            before = signal.getsignal(signal.SIGTERM) if main else None
            if _address:
                ray.init(address=_address, log_to_driver=True)
            else:
                ray.init(include_dashboard=False, log_to_driver=True)
            if main:
                signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)
    return ray


def remote_worker() -> Any:
    """The worker actor class, made remote once."""
    global _worker_class
    ray = ray_module()
    from vllm_omni_like.executor.ray_worker import CONCURRENCY, WorkerActor

    with _lock:
        if _worker_class is None:
            _worker_class = ray.remote(concurrency_groups=CONCURRENCY)(WorkerActor)
        return _worker_class


def shutdown(joined_too: bool = False) -> None:
    """Stop the local instance this process started (the server's last step). A joined
    cluster stays connected (the process's exit leaves it) unless `joined_too`: engines made
    one after another in a process (tests) keep one connection."""
    import sys

    global _worker_class
    ray = sys.modules.get("ray")
    with _lock:
        if ray is None or not ray.is_initialized() or (_address and not joined_too):
            return
        _worker_class = None  # a remote class belongs to the connection (job) it was made in
        ray.shutdown()
