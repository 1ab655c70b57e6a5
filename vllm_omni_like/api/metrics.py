"""Prometheus metrics: request final statuses, queues, latencies, batches, deaths, replicas."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from vllm_omni_like.engine import AsyncOmni
from vllm_omni_like.engine.request_state import FINAL_STATUSES, BatchReport

PREFIX = "vllm_omni_like"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)


class _EngineCollector:
    """Reads the engine's counters and pools at scrape time (no double bookkeeping)."""

    def __init__(self, engine: AsyncOmni) -> None:
        self.engine = engine

    def collect(self):
        snap = self.engine.stats.snapshot()
        final = CounterMetricFamily(
            f"{PREFIX}_requests_finished",
            "Admitted requests by final status (sums to requests_total once none is in flight)",
            labels=["status"],
        )
        for status in FINAL_STATUSES:
            final.add_metric([status], snap["final"][status])
        yield final
        rejected = CounterMetricFamily(
            f"{PREFIX}_requests_rejected", "Requests refused before admission", labels=["status"]
        )
        for status, count in sorted(snap["rejected"].items()):
            rejected.add_metric([str(status)], count)
        yield rejected
        for field, name, help_text in (
            ("requests_total", "requests", "Requests admitted to the engine"),
            ("worker_deaths", "worker_deaths", "Worker processes that died"),
            ("restarts", "replica_restarts", "Replicas restarted"),
            ("compiles", "compiles", "torch.compile compilations workers started (warm-up too)"),
        ):
            counter = CounterMetricFamily(f"{PREFIX}_{name}", help_text)
            counter.add_metric([], snap[field])
            yield counter
        labels = ["pipeline", "stage"]
        waiting = GaugeMetricFamily(f"{PREFIX}_requests_waiting", "Queued per stage", labels=labels)
        running = GaugeMetricFamily(
            f"{PREFIX}_requests_running", "Running per stage", labels=labels
        )
        alive = GaugeMetricFamily(
            f"{PREFIX}_replicas_alive", "Live replicas per stage", labels=labels
        )
        per_replica = ["pipeline", "stage", "replica", "device"]
        replica_up = GaugeMetricFamily(
            f"{PREFIX}_replica_up", "1 while a replica is live, else 0", labels=per_replica
        )
        gpu_memory = GaugeMetricFamily(
            f"{PREFIX}_replica_gpu_memory_bytes",
            "GPU memory a replica's worker holds (its CUDA caching allocator)",
            labels=per_replica,
        )
        family = GaugeMetricFamily(
            f"{PREFIX}_stage_family",
            "1 for the model family (adapter) of a diffusion stage and the denoising loop each "
            "of its modes runs (own, or the diffusers pipeline's call)",
            labels=["pipeline", "stage", "family", "mode", "loop"],
        )
        for stage in self.engine.orchestrator.snapshot.stages:  # never the pools themselves
            key = [stage.pipeline, stage.name]
            if stage.family is not None:
                for mode, loop in stage.family["loops"].items():
                    family.add_metric([*key, stage.family["family"], mode, loop], 1.0)
            waiting.add_metric(key, stage.waiting)
            running.add_metric(key, stage.running)  # denoising, and batches still decoding
            alive.add_metric(key, stage.replicas_live)
            for r in stage.replicas:
                labels = [*key, str(r.index), r.device]
                replica_up.add_metric(labels, 1.0 if r.state == "ready" else 0.0)
                gpu_memory.add_metric(labels, r.gpu_memory)
        yield from (waiting, running, alive, replica_up, gpu_memory, family, *_starts(self.engine))


def _starts(engine: AsyncOmni) -> tuple[GaugeMetricFamily | CounterMetricFamily, ...]:
    """What each replica's last start and restart took, and what its compile cache held (and
    its idle-expert offload's figures, `_offloads`)."""
    labels = ["pipeline", "stage", "replica", "device"]
    start = GaugeMetricFamily(
        f"{PREFIX}_replica_start_seconds",
        "Seconds a replica's last start took in its worker: load, compile (or the compile "
        "cache) and warm-up",
        labels=labels,
    )
    restart = GaugeMetricFamily(
        f"{PREFIX}_replica_restart_seconds",
        "Seconds a replica's last restart took, from its worker's death to ready again",
        labels=labels,
    )
    cache = GaugeMetricFamily(
        f"{PREFIX}_replica_compile_cache_graphs",
        "Compiled graphs a replica's last start loaded from the compile cache (hit), "
        "compiled anew (miss), loaded as precompiled forwards without a trace (precompiled), "
        "or traced by dynamo (traced)",
        labels=[*labels, "result"],
    )
    for stage in engine.orchestrator.snapshot.stages:
        for r in stage.replicas:
            key = [stage.pipeline, stage.name, str(r.index), r.device]
            if r.start is not None:
                start.add_metric(key, r.start.seconds)
                if r.start.cache_dir:
                    cache.add_metric([*key, "hit"], r.start.cache_hits)
                    cache.add_metric([*key, "miss"], r.start.cache_misses)
                    cache.add_metric([*key, "precompiled"], r.start.precompiled)
                    cache.add_metric([*key, "traced"], r.start.traced)
            if r.restart_seconds is not None:
                restart.add_metric(key, r.restart_seconds)
    return start, restart, cache, *_offloads(engine)


def _offloads(
    engine: AsyncOmni,
) -> tuple[CounterMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
    """Each replica's idle-expert offload (`--offload idle-expert`), as its worker last said:
    its swaps a counter (`..._total`; a restarted worker's start again from 0, a reset)."""
    labels = ["pipeline", "stage", "replica", "device"]
    swaps = CounterMetricFamily(
        f"{PREFIX}_replica_expert_swaps",
        "Expert swaps of a replica's worker since its start (--offload idle-expert)",
        labels=labels,
    )
    last = GaugeMetricFamily(
        f"{PREFIX}_replica_expert_swap_seconds",
        "Seconds the copy stream took for a replica's last expert swap",
        labels=labels,
    )
    held = GaugeMetricFamily(
        f"{PREFIX}_replica_expert_device_bytes",
        "Bytes of expert weights on a replica's device (one expert, and a prefetch)",
        labels=labels,
    )
    for stage in engine.orchestrator.snapshot.stages:
        for r in stage.replicas:
            if (offload := r.offload) is not None:
                key = [stage.pipeline, stage.name, str(r.index), r.device]
                swaps.add_metric(key, offload.swaps)
                held.add_metric(key, offload.device_bytes)
                if offload.last_swap_s is not None:
                    last.add_metric(key, offload.last_swap_s)
    return swaps, last, held


class Metrics:
    def __init__(self, engine: AsyncOmni) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.e2e = Histogram(
            f"{PREFIX}_e2e_latency_seconds",
            "End-to-end latency by final status",
            ["pipeline", "status"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.stage = Histogram(
            f"{PREFIX}_stage_latency_seconds",
            "Time in a stage's worker",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.batch = Histogram(
            f"{PREFIX}_batch_size",
            "Requests per executed batch",
            ["stage"],
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=self.registry,
        )
        self.after_abort = Histogram(
            f"{PREFIX}_steps_after_abort",
            "Steps a stage ran for a request after its abort reached the worker",
            ["stage"],
            buckets=(0, 1, 2, 4, 8, 16, 32),
            registry=self.registry,
        )
        self.phase = Histogram(
            f"{PREFIX}_batch_phase_seconds",
            "Seconds of a batch's parts in its worker: denoise (the critical path), finish "
            "(the decode, beside the next batch)",
            ["stage", "phase"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.video_encode = Histogram(
            f"{PREFIX}_video_encode_seconds",
            "Seconds to encode and store a finished video (MP4 and thumbnail)",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        stats = engine.stats
        stats.observers.append(lambda p, s, t: self.e2e.labels(p, s).observe(t))
        stats.stage_observers.append(lambda st, t: self.stage.labels(st).observe(t))
        stats.batch_observers.append(self._batch)

    def _batch(self, report: BatchReport) -> None:
        self.batch.labels(report.stage).observe(report.size)
        for phase, seconds in report.phases.items():
            self.phase.labels(report.stage, phase).observe(seconds)
        for steps in report.steps_after_abort.values():
            self.after_abort.labels(report.stage).observe(steps)

    def render(self) -> bytes:
        return generate_latest(self.registry)
