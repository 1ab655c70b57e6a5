"""What a message costs between the server and a worker: a Ray actor call against our pipe.

    python bench/ray_roundtrip.py          # bench/results/ray_roundtrip-cpu.json

Measured before the Ray executor's design is fixed (issue: per-step Ray calls may cost too
much). On a local Ray instance (dashboard off) and a spawned process with our pipe transport:

- call: a round trip of an empty call (`ray.get(actor.ping.remote())`; pipe: send, echo, recv),
  sequential; p50/p99 over `--calls`;
- array: the same with a 1 MiB numpy array back (Ray: through the object store);
- event: the long-poll pattern a Ray executor would read its worker with: the server keeps one
  `events()` call outstanding, the actor answers it with what it queued; the time from the
  actor's queueing of a message (its clock) to the server holding it, against the pipe's;
- burst: 100 messages (progress of one step of many requests) queued at once, until all are
  at the server: one long-poll answer carries them all.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import threading
import time
from typing import Any

import numpy as np

from vllm_omni_like.executor import transport

HERE = os.path.dirname(os.path.abspath(__file__))


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {"p50_ms": round(pct(ms, 0.5), 3), "p99_ms": round(pct(ms, 0.99), 3), "n": len(ms)}


# ---- the pipe: a spawned process that echoes ------------------------------------------------
def _echo(conn: Any) -> None:
    lock = threading.Lock()
    while True:
        msg = transport.recv(conn)
        if msg is None:
            return
        kind, payload = msg
        if kind == "ping":
            transport.send(conn, None, lock)
        elif kind == "array":
            transport.send(conn, np.ones(1 << 20, np.uint8), lock)
        elif kind == "event":  # a message stamped with this process's clock
            transport.send(conn, time.perf_counter(), lock)
        elif kind == "burst":
            for i in range(payload):
                transport.send(conn, i, lock)


def pipe_figures(calls: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_echo, args=(child,), daemon=True)
    proc.start()
    lock = threading.Lock()

    def rt(kind: str, payload: Any = None) -> float:
        t0 = time.perf_counter()
        transport.send(parent, (kind, payload), lock)
        transport.recv(parent)
        return time.perf_counter() - t0

    for _ in range(50):
        rt("ping")
    out = {
        "call": summary([rt("ping") for _ in range(calls)]),
        "array": summary([rt("array") for _ in range(calls // 4)]),
    }
    delays = []
    for _ in range(calls):
        transport.send(parent, ("event", None), lock)
        stamped = transport.recv(parent)
        delays.append(time.perf_counter() - stamped)  # same host: one monotonic clock
    out["event"] = summary(delays)
    bursts = []
    for _ in range(20):
        t0 = time.perf_counter()
        transport.send(parent, ("burst", 100), lock)
        for _ in range(100):
            transport.recv(parent)
        bursts.append(time.perf_counter() - t0)
    out["burst_100"] = summary(bursts)
    transport.send(parent, None, lock)
    proc.join(5)
    return out


# ---- Ray ------------------------------------------------------------------------------------
def ray_figures(calls: int) -> dict[str, Any]:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0, max_concurrency=4)
    class Echo:
        def __init__(self) -> None:
            self.outbox: queue.Queue[Any] = queue.Queue()

        def ping(self) -> None:
            return None

        def array(self) -> np.ndarray:
            return np.ones(1 << 20, np.uint8)

        def queue_events(self, n: int) -> None:
            for i in range(n):
                self.outbox.put((i, time.perf_counter()))

        def events(self) -> list[Any]:
            items = [self.outbox.get()]
            while True:
                try:
                    items.append(self.outbox.get_nowait())
                except queue.Empty:
                    return items

    try:
        actor = Echo.remote()
        ray.get(actor.ping.remote())

        def rt(method: Any) -> float:
            t0 = time.perf_counter()
            ray.get(method.remote())
            return time.perf_counter() - t0

        for _ in range(50):
            rt(actor.ping)
        out = {
            "call": summary([rt(actor.ping) for _ in range(calls)]),
            "array": summary([rt(actor.array) for _ in range(calls // 4)]),
        }
        delays = []
        for _ in range(calls):
            pending = actor.events.remote()  # outstanding before the event exists
            ray.get(actor.queue_events.remote(1))
            ((_, stamped),) = ray.get(pending)
            delays.append(time.perf_counter() - stamped)
        out["event"] = summary(delays)
        bursts = []
        for _ in range(20):
            t0 = time.perf_counter()
            ray.get(actor.queue_events.remote(100))
            got = 0
            while got < 100:
                got += len(ray.get(actor.events.remote()))
            bursts.append(time.perf_counter() - t0)
        out["burst_100"] = summary(bursts)
        out["ray"] = ray.__version__
        return out
    finally:
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "ray_roundtrip-cpu.json"))
    args = ap.parse_args()
    report = {
        "machine": f"{os.cpu_count()} CPU cores",
        "pipe": pipe_figures(args.calls),
        "ray": ray_figures(args.calls),
    }
    report["ray_over_pipe_p50"] = {
        k: round(report["ray"][k]["p50_ms"] / report["pipe"][k]["p50_ms"], 1)
        for k in ("call", "array", "event", "burst_100")
    }
    print(json.dumps(report, indent=2))
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
