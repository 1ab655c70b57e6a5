"""The Ray executor (`--executor ray`): one replica's workers as Ray actors, on any node.

Same contract as the multi-process executor (executor/base.py), same worker loop
(executor/ray_worker.py). Each replica owns a placement group (one bundle per worker: a GPU and
a CPU for a CUDA stage, a CPU for a CPU stage; the bundles of a replica on one node), made at
start and removed at shutdown or death: a restarted replica gets a new one, on any node with
room. Messages to a worker are actor calls in its `control` group (never behind a running
batch); its messages come back through one outstanding `events` call per worker (long-poll:
every queued message in one answer), read by a thread per worker that sorts them (`Inbound`).
That call failing (`RayActorError`: the actor's process died, was killed, or its node was lost)
is the death: the other workers are killed, the placement group removed, and `ReplicaDied`
lists what was in flight, as with processes.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import threading
import time
from typing import Any

from vllm_omni_like.config import FaultRule, StageConfig
from vllm_omni_like.errors import EngineDeadError, ShuttingDownError
from vllm_omni_like.executor import placement
from vllm_omni_like.executor.base import MessageSink
from vllm_omni_like.executor.inbound import InboundExecutor
from vllm_omni_like.executor.ray_runtime import ray_module, remote_worker
from vllm_omni_like.wire import AbortRequests, ExecuteBatch, ReplicaDied, Shutdown, WorkerReady

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0


class RayExecutor(InboundExecutor):
    def __init__(
        self,
        config: StageConfig,
        replica: int,
        sink: MessageSink,
        faults: tuple[FaultRule, ...] = (),
    ) -> None:
        super().__init__(sink)
        self.config, self.replica, self.faults = config, replica, faults
        self.devices = placement.rank_devices(config, replica)
        self._actors: list[Any] = []
        self._readers: list[threading.Thread] = []
        self._group: Any = None
        self._pids: list[int] = []
        self._started = False
        self._death: ReplicaDied | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        ray = ray_module()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpu = [placement.gpu_index(d) is not None for d in self.devices]
        bundles = [{"CPU": 1.0, "GPU": 1.0} if g else {"CPU": 1.0} for g in gpu]
        try:
            with self._lock:
                if self._stopping:
                    raise self._stopped()
                self._group = placement_group(bundles, strategy="STRICT_PACK")
            if not self._group.wait(self.config.load_timeout):
                raise EngineDeadError(
                    f"replica {self.replica}: no node has room for {bundles} "
                    f"within {self.config.load_timeout:.0f}s",
                    stage=self.config.name,
                )
            for rank, on_gpu in enumerate(gpu):
                strategy = PlacementGroupSchedulingStrategy(self._group, rank)
                actor = (
                    remote_worker()
                    .options(
                        num_cpus=1,
                        num_gpus=1 if on_gpu else 0,
                        max_restarts=0,
                        max_task_retries=0,
                        scheduling_strategy=strategy,
                    )
                    .remote(self.config, rank, "cuda:0" if on_gpu else "cpu", self.faults)
                )
                with self._lock:
                    if self._stopping:
                        ray.kill(actor)
                        raise self._stopped()
                    self._actors.append(actor)
                reader = threading.Thread(
                    target=self._read_forever,
                    args=(rank, actor),
                    daemon=True,
                    name=f"ray-reader-{self.config.name}-r{self.replica}-w{rank}",
                )
                self._readers.append(reader)
                reader.start()
            self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        with self._lock:
            self._started = True
            died = self._dead  # between its hello and now: its death is reported now
        if died and self._death is not None:
            self._report(self._death)

    def _stopped(self) -> ShuttingDownError:
        return ShuttingDownError(
            f"replica {self.replica}: loading stopped: the engine is shutting down",
            stage=self.config.name,
        )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.config.load_timeout
        ready: set[int] = set()
        where = f"replica {self.replica}"
        while len(ready) < len(self.devices):
            if self._stopping:
                raise self._stopped()
            if self._dead:
                raise EngineDeadError(
                    f"{where}: a worker died while loading ({self._kill_reason})",
                    stage=self.config.name,
                )
            if time.monotonic() > deadline:
                raise EngineDeadError(
                    f"{where}: load timed out after {self.config.load_timeout:.0f}s",
                    stage=self.config.name,
                )
            try:
                msg = self._inbound.startup.get(timeout=0.05)
            except queue.Empty:
                continue
            self._hello(msg, ready, self.config.name, where)
            if isinstance(msg, WorkerReady):
                self._pids.append(msg.pid)

    def shutdown(self) -> None:
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            actors = list(self._actors)
        if not actors and self._group is None:
            self._dead = True
            return
        ray = ray_module()
        for actor in actors:
            self._call(actor, "deliver", Shutdown())
        joins = [actor.join.options(concurrency_group="control").remote(5) for actor in actors]
        with contextlib.suppress(Exception):
            ray.wait(joins, num_returns=len(joins), timeout=SHUTDOWN_GRACE_S)
        self._kill_all(ray, actors)
        for reader in self._readers:
            if reader is not threading.current_thread():
                reader.join(2)
        self._dead = True

    @staticmethod
    def _kill_actors(ray: Any, actors: list[Any]) -> None:
        for actor in actors:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(actor, no_restart=True)

    def _kill_all(self, ray: Any, actors: list[Any]) -> None:
        self._kill_actors(ray, actors)
        group, self._group = self._group, None
        if group is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(group)

    # ---- work --------------------------------------------------------------------------------
    def execute(self, batch: ExecuteBatch) -> None:
        with self._lock:
            if self._dead or self._stopping:
                raise EngineDeadError(f"replica {self.replica} is dead", stage=self.config.name)
            self._inbound.sent(batch.batch_id, {r.request_id for r in batch.requests})
            actors = list(self._actors)
        for actor in actors:
            self._call(actor, "deliver", batch)

    def abort(self, request_ids: list[str]) -> None:
        for actor in list(self._actors):
            self._call(actor, "deliver", AbortRequests(list(request_ids)))

    @staticmethod
    def _call(actor: Any, method: str, msg: object) -> None:
        """Fire and forget: a failure shows as the actor's death, on its reader."""
        getattr(actor, method).options(concurrency_group="control").remote(msg)

    def kill(self, reason: str) -> None:
        self._kill_reason = reason
        self._kill_actors(ray_module(), list(self._actors))

    @property
    def pids(self) -> list[int]:
        return list(self._pids)

    # ---- threads -----------------------------------------------------------------------------
    def _read_forever(self, rank: int, actor: Any) -> None:
        """Two `events` calls outstanding, read oldest first (the messages' order): the actor
        starts the second as it answers the first, so no message waits for a call to come."""
        ray = ray_module()

        def ask() -> Any:
            return actor.events.options(concurrency_group="events").remote()

        pending = collections.deque([ask(), ask()])
        while not self._stopping:
            try:
                messages = ray.get(pending.popleft())
            except Exception as exc:  # RayActorError and kin: the actor is gone
                if not self._stopping:
                    self._on_death(rank, exc)
                return
            pending.append(ask())
            for msg in messages:
                self._inbound.route(msg)

    def _on_death(self, rank: int, exc: BaseException) -> None:
        with self._lock:
            if self._dead:
                return
            self._dead = True
            actors = list(self._actors)
            lost = self._inbound.lost()
            started = self._started
        text = str(exc).strip()
        desc = f"actor {type(exc).__name__}: {text.splitlines()[0] if text else 'gone'}"
        if self._kill_reason:
            desc = f"{desc} ({self._kill_reason})"
        name, replica = self.config.name, self.replica
        logger.error("stage %s replica %d: worker %d %s", name, replica, rank, desc)
        self._kill_reason = self._kill_reason or desc
        self._kill_all(ray_module(), actors)
        self._death = ReplicaDied(self.config.name, self.replica, desc, lost)
        if started:  # during the load, start() raises instead
            self._report(self._death)
