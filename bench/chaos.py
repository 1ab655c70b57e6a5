"""Chaos run: a seeded random mix of faults, kills, hangs and disconnects under load.

    python bench/chaos.py --minutes 10 --seed 1

Starts the real server (null pipelines, three replicas a stage) as its own process, drives
closed-loop clients over HTTP, and at random moments SIGKILLs or SIGSTOPs a worker and drops
client connections, while VLLM_OMNI_LIKE_FAULTS injects every fault kind at every point. Among
the requests: clients that share a few x-request-ids, 1 MB image edits (large messages to
workers that may be stopped), steps slower than the stall timeout (must not be killed for it),
and streams with partial images (a partial index seen twice is a re-run stream). It
reports requests, faults by kind and point, final statuses, hung requests (must be 0), the time
from a fault to its error reaching the client, and leaked processes, /dev/shm entries and fds
(must be 0). Results: bench/results/chaos-cpu.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter

import httpx
import psutil
from server_proc import free_port, serve_command, wait_healthy

from vllm_omni_like.config import parse_faults
from vllm_omni_like.stages.faults import selects
from vllm_omni_like.wire import StageRequest

STAGES, POINTS = ("llm", "diffusion"), ("execute", "step", "output")
KIND_P = {"raise": 0.006, "invalid": 0.006, "oom": 0.006, "exit": 0.004, "hang": 0.004}
REQUEST_TIMEOUT = 10.0
HUNG_AFTER = REQUEST_TIMEOUT + 10.0
KINDS = ("plain", "dup", "edit", "slow", "stream")
KIND_WEIGHTS = (0.8, 0.05, 0.05, 0.03, 0.07)


def _edit_png() -> bytes:
    import io

    import numpy as np
    from PIL import Image

    noise = np.random.default_rng(0).integers(0, 256, (512, 512, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, format="PNG", compress_level=0)
    return buf.getvalue()


EDIT_PNG = _edit_png()


def fault_rules() -> str:
    rules, seed = [], 100
    for stage in STAGES:
        for point in POINTS:
            for kind, p in KIND_P.items():
                seed += 1
                rules.append(f"stage={stage},point={point},kind={kind},p={p},seed={seed}")
        for kind in ("raise", "exit"):
            rules.append(f"stage={stage},point=load,kind={kind},p=0.08,seed={seed + 50}")
    return ";".join(rules)


def first_fault(rules, rid: str, prompt: str):
    probe = StageRequest(rid, prompt)
    for stage in STAGES:
        for point in POINTS:
            for rule in rules:
                if (rule.stage, rule.point) == (stage, point) and selects(rule, probe):
                    return rule
    return None


class Chaos:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.faults = fault_rules()
        self.rules = parse_faults(self.faults)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.marker = uuid.uuid4().hex
        self.statuses: Counter[str] = Counter()
        self.predicted: Counter[str] = Counter()
        self.events: Counter[str] = Counter()
        self.fault_to_error: list[float] = []
        self.kills: list[tuple[float, int]] = []
        self.hung: list[str] = []
        self.requests = 0

    # ---- the server -------------------------------------------------------------------------
    def start_server(self, storage: str) -> subprocess.Popen:
        env = {
            **os.environ,
            "VLLM_OMNI_LIKE_FAULTS": self.faults,
            "VLLM_OMNI_LIKE_TEST_MARKER": self.marker,
        }
        args = [
            "null-omni",
            "--replicas",
            "3",
            "--max-restarts",
            "100000",
            "--stall-timeout",
            "0.5",
            "--cold-step-timeout",
            "1.0",
            "--request-timeout",
            str(REQUEST_TIMEOUT),
            "--max-queue-size",
            "1000",
        ]
        cmd = serve_command(args, self.port, storage)
        for _ in range(30):  # load faults may fail a start: the server then exits non-zero
            with open(os.path.join(storage, "server.log"), "a") as log:
                proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            if wait_healthy(proc, self.port):
                return proc
            proc.kill()
            proc.wait(10)
            self.events["startup_failed"] += 1
        raise RuntimeError("server never became healthy")

    def marked(self) -> list[psutil.Process]:
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

    def workers(self, server_pid: int) -> list[psutil.Process]:
        return [
            p
            for p in self.marked()
            if p.pid != server_pid and "resource_tracker" not in " ".join(p.cmdline())
        ]

    # ---- load -----------------------------------------------------------------------------------
    def request(self, http: httpx.AsyncClient, rid: str, kind: str, body: dict):
        """The call for one request of `kind` (plain, dup, edit, slow, stream)."""
        headers = {"x-request-id": rid}
        if kind == "edit":
            form = {k: str(v) for k, v in body.items()}
            files = {"image": ("in.png", EDIT_PNG, "image/png")}
            return http.post("/v1/images/edits", data=form, files=files, headers=headers)
        if kind == "stream":
            return self.stream(http, {**body, "stream": True, "partial_images": 2}, headers)
        return http.post("/v1/images/generations", json=body, headers=headers)

    async def stream(self, http: httpx.AsyncClient, body: dict, headers: dict) -> httpx.Response:
        """Reads the SSE stream; a partial image index seen twice means the stream was re-run."""
        seen: list[int] = []
        async with http.stream("POST", "/v1/images/generations", json=body, headers=headers) as r:
            error = None
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    data = json.loads(line[6:])
                    if "partial_image_index" in data:
                        seen.append(data["partial_image_index"])
                    error = data.get("error", error)
        if len(seen) != len(set(seen)):
            self.events["stream_rerun"] += 1
        status = (
            r.status_code if error is None else 500 if error["code"] != "invalid_request" else 400
        )
        return httpx.Response(status, json={"error": error} if error else {})

    async def client(self, http: httpx.AsyncClient, end: float) -> None:
        while time.monotonic() < end:
            kind = self.rng.choices(KINDS, KIND_WEIGHTS)[0]
            rid = f"chaos-{uuid.uuid4().hex[:16]}"
            if kind == "dup":  # a few ids shared by many clients, in flight together
                rid = f"chaos-dup-{self.rng.randrange(3)}"
            delay = 0.7 if kind == "slow" else 0.004  # slow: each step over the stall timeout
            prompt = f"p{self.rng.randrange(10_000)} @delay={delay}"
            rule = first_fault(self.rules, rid, prompt)
            body = {
                "prompt": prompt,
                "seed": self.rng.randrange(2**31),
                "num_inference_steps": 2 if kind == "slow" else self.rng.randint(2, 6),
            }
            leave = self.rng.uniform(0.01, 0.5) if self.rng.random() < 0.1 else None
            self.requests += 1
            self.events[f"kind:{kind}"] += 1
            t0 = time.monotonic()
            call = asyncio.create_task(self.request(http, rid, kind, body))
            try:
                if leave is not None:
                    await asyncio.sleep(leave)
                    if not call.done():
                        call.cancel()
                        self.statuses["client_disconnected"] += 1
                        self.events["disconnect"] += 1
                        continue
                r = await asyncio.wait_for(call, HUNG_AFTER)
            except TimeoutError:
                self.hung.append(rid)
                continue
            except (httpx.TransportError, asyncio.CancelledError) as exc:
                self.statuses[f"transport:{type(exc).__name__}"] += 1
                continue
            self.statuses[str(r.status_code)] += 1
            if kind == "slow" and r.status_code == 200:
                self.events["slow_ok"] += 1
            if r.status_code in (429, 503) and "retry-after" in r.headers:
                await asyncio.sleep(0.2)  # refused at admission: back off as the SDK would
                continue
            if rule is not None:  # admitted: the fault was met on its way
                self.predicted[f"{rule.kind}@{rule.stage}.{rule.point}"] += 1
            self.note_error(r, t0)

    def note_error(self, r: httpx.Response, t0: float) -> None:
        if r.status_code == 200:
            return
        now = time.monotonic()
        message = r.json().get("error", {}).get("message", "")
        stamp = re.search(r"\(t=([0-9.]+)\)", message)
        if stamp:
            self.fault_to_error.append(now - float(stamp.group(1)))
        elif r.status_code in (500, 503):
            kill = next((t for t, _ in reversed(self.kills) if t0 <= t <= now), None)
            if kill is not None:
                self.fault_to_error.append(now - kill)

    async def saboteur(self, server_pid: int, end: float) -> None:
        while time.monotonic() < end:
            await asyncio.sleep(self.rng.uniform(3, 12))
            workers = self.workers(server_pid)
            if not workers:
                continue
            victim = self.rng.choice(workers)
            sig = signal.SIGKILL if self.rng.random() < 0.7 else signal.SIGSTOP
            try:
                os.kill(victim.pid, sig)
            except ProcessLookupError:
                continue
            self.kills.append((time.monotonic(), victim.pid))
            self.events["sigkill" if sig == signal.SIGKILL else "sigstop"] += 1

    async def drive(self, server_pid: int) -> None:
        end = time.monotonic() + self.args.minutes * 60
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with httpx.AsyncClient(
            base_url=self.url, timeout=HUNG_AFTER + 5, limits=limits
        ) as http:
            await asyncio.gather(
                self.saboteur(server_pid, end),
                *(self.client(http, end) for _ in range(self.args.clients)),
            )

    # ---- the run ------------------------------------------------------------------------------
    def run(self) -> dict:
        import tempfile

        shm_before = set(os.listdir("/dev/shm"))
        fds_before = psutil.Process().num_fds()
        storage = tempfile.mkdtemp(prefix="chaos-")
        proc = self.start_server(storage)
        t0 = time.monotonic()
        asyncio.run(self.drive(proc.pid))
        metrics = httpx.get(f"{self.url}/metrics", timeout=10).text
        health = httpx.get(f"{self.url}/health", timeout=10).status_code
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
        time.sleep(1)
        leaked = self.marked()
        for p in leaked:
            p.kill()
        samples = sorted(self.fault_to_error)
        with open(os.path.join(storage, "server.log")) as f:  # load faults: seen by the server
            loads = Counter(re.findall(r"injected (\w+) fault at load", f.read()))

        def pct(q: float) -> float | None:
            return (
                round(samples[min(len(samples) - 1, int(q * len(samples)))], 4) if samples else None
            )

        return {
            "device": "cpu",
            "minutes": round((time.monotonic() - t0) / 60, 2),
            "seed": self.args.seed,
            "clients": self.args.clients,
            "requests": self.requests,
            "faults_predicted": dict(sorted(self.predicted.items())),
            "load_faults": dict(loads),
            "faults_by_kind": {
                k: sum(v for f, v in self.predicted.items() if f.startswith(k + "@"))
                for k in KIND_P
            },
            "events": dict(self.events),
            "client_statuses": dict(self.statuses),
            "engine_final_statuses": {
                m[0]: float(m[1])
                for m in re.findall(
                    r'vllm_omni_like_requests_finished_total\{status="(\w+)"\} ([0-9.e+]+)', metrics
                )
            },
            "engine_requests_total": float(
                re.search(r"^vllm_omni_like_requests_total ([0-9.e+]+)", metrics, re.M).group(1)
            ),
            "worker_deaths": float(
                re.search(r"^vllm_omni_like_worker_deaths_total ([0-9.e+]+)", metrics, re.M).group(
                    1
                )
            ),
            "health_at_end": health,
            "server_exit_code": code,
            "hung_requests": len(self.hung),
            "fault_to_error_s": {"n": len(samples), "p50": pct(0.5), "p99": pct(0.99)},
            "leaked_processes": len(leaked),
            "leaked_shm": len(set(os.listdir("/dev/shm")) - shm_before),
            "leaked_fds": max(0, psutil.Process().num_fds() - fds_before),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--clients", type=int, default=24)
    parser.add_argument("--out", default="bench/results/chaos-cpu.json")
    args = parser.parse_args()
    report = Chaos(args).run()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))
    bad = (
        report["hung_requests"]
        or report["leaked_processes"]
        or report["leaked_shm"]
        or report["leaked_fds"]
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
