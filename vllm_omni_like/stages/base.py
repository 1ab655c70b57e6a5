"""The Stage contract, run in a worker: `load` once, then per batch `begin(batch, control)` and
the returned part's `finish` (the worker calls them apart, through isolation.py), or, for the
modes `stepped_modes` names, a `stepper`'s running set. `execute` (both at once) is called only
by tests."""

from __future__ import annotations

import importlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm_omni_like.config import StageConfig
from vllm_omni_like.outputs import StageOutput
from vllm_omni_like.parallel.ranks import Ranks
from vllm_omni_like.stage_options import typed
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.wire import Mode, OffloadReport, StageRequest


def preview_steps(total: int, k: int) -> set[int]:
    """The steps (1-based, all before the last) after which k partial images are taken."""
    return {max(1, round(total * (j + 1) / (k + 1))) for j in range(k)} - {total}


class StageAborted(Exception):
    """Raised by `StageControl.step` (inside `begin` or a running set's step) once every
    request of the batch was aborted."""


class StageControl:
    """What a running stage sees of the world: progress reporting, aborts, injected faults."""

    def __init__(
        self,
        faults: FaultInjector,
        on_progress: Callable[..., None] | None = None,
    ) -> None:
        self.faults = faults
        self._on_progress = on_progress
        self._aborted: set[str] = set()
        self._lock = threading.Lock()
        self.steps_run: dict[str, int] = {}
        self.steps_at_abort: dict[str, int] = {}  # the step count when the abort arrived
        self.max_model_batch = 0
        # set by the worker while a batch begins: a row's output goes out through it at once
        self.report: Callable[[StageOutput], None] | None = None
        # set by the worker: after an out-of-memory error, waits for the memory that a batch
        # being finished beside holds (its decode) to come back; False if none was held
        self.reclaim: Callable[[], bool] | None = None

    def deliver(self, output: StageOutput) -> None:
        """Send a row's final output now, before its batch ends (an LLM row that finished or
        failed early: its waiter wakes now). The batch's outputs may carry it again: the worker
        sends each request's output once."""
        if self.report is not None:
            self.report(output)

    # -- aborts: written by the worker's receiver thread, read between steps ---------------------
    def abort(self, request_ids: list[str]) -> None:
        with self._lock:
            for rid in request_ids:
                if rid not in self._aborted:
                    self.steps_at_abort[rid] = self.steps_run.get(rid, 0)
            self._aborted.update(request_ids)

    def forget(self, request_ids: list[str]) -> None:
        with self._lock:
            self._aborted.difference_update(request_ids)
            for rid in request_ids:
                self.steps_run.pop(rid, None)
                self.steps_at_abort.pop(rid, None)

    def steps_after_abort(self, request_ids: list[str]) -> dict[str, int]:
        """For the aborted ones of `request_ids`: how many steps ran after their abort arrived."""
        with self._lock:
            return {
                rid: self.steps_run.get(rid, 0) - self.steps_at_abort.get(rid, 0)
                for rid in request_ids
                if rid in self._aborted
            }

    def is_aborted(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._aborted

    def live(self, batch: list[StageRequest]) -> list[StageRequest]:
        with self._lock:
            return self._live(batch)

    def _live(self, batch: list[StageRequest]) -> list[StageRequest]:  # the lock held
        return [r for r in batch if r.request_id not in self._aborted]

    # -- the step boundary -------------------------------------------------------------------------
    def step(
        self,
        batch: list[StageRequest],
        step: int,
        total: int,
        previews: dict[str, Any] | None = None,
        progress: dict[str, tuple[int, int]] | None = None,
        fire: bool = True,
    ) -> None:
        """Call after each denoising/decoding step; raises StageAborted once nobody needs it.
        `progress`: the (step, total) of each request that stepped, where they differ (rows
        with their own step counts); the others of `batch` did not step. `fire=False`: the
        step's faults fired already (a running set fires them before it commits the step)."""
        if fire:
            self.faults.fire("step", batch)
        with self._lock:  # the abort check and the count together: no abort slips between them
            live = self._live(batch)
            for r in live:
                if progress is None or r.request_id in progress:
                    self.steps_run[r.request_id] = self.steps_run.get(r.request_id, 0) + 1
        if not live:
            raise StageAborted()
        if self._on_progress is not None:
            ids = [r.request_id for r in live if progress is None or r.request_id in progress]
            self._on_progress(ids, step, total, previews or {}, progress)

    def wants_preview(self, request: StageRequest, step: int, total: int) -> bool:
        """Partial images come from real intermediate steps, spread before the last one."""
        k = request.params.partial_images
        return k > 0 and step in preview_steps(total, k) and not self.is_aborted(request.request_id)

    def saw_model_batch(self, size: int) -> None:
        self.max_model_batch = max(self.max_model_batch, size)


@dataclass
class Deferred:
    """A batch whose critical-path part ran (a diffusion stage: the denoising loop).

    `finish(requests)` completes any in-order subset of `requests` (a diffusion stage: the VAE
    decode and the conversion to uint8 pixels) and returns their outputs. The worker calls it on
    its finisher thread while the next batch runs, and on halves of the subset when it raises
    (isolation), so it must not consume what it finishes.
    """

    requests: list[StageRequest]
    finish: Callable[[list[StageRequest]], list[StageOutput]]

    @classmethod
    def done(cls, batch: list[StageRequest], outputs: list[StageOutput]) -> Deferred:
        """A batch that ran whole in `begin`: `finish` only hands its outputs out."""
        by_id = {out.request_id: out for out in outputs}
        return cls(batch, lambda requests: [by_id[r.request_id] for r in requests])


class RowStepper(ABC):
    """A stage's running set of rows: the worker's side of the running-set contract.

    Groups of requests `join` at a step boundary (rows of one shape group: which group joins
    which set, and when, is the worker's running-set policy's, executor/join_policy.py), `step`
    advances every live row one step (a subset with `only`: bisection) and reports progress, and
    `leave` takes out the requests whose rows all ended (their rest deferred, as `begin`'s) and
    drops the aborted ones. A `join` or `step` that raises changes nothing, so the worker can
    re-run halves to find the culprit; the step's faults fire before it is committed.
    """

    @property
    @abstractmethod
    def requests(self) -> list[StageRequest]:
        """The requests in the set (joined, not yet left)."""

    @property
    def stepping(self) -> list[StageRequest]:
        """The requests whose rows still step: the set's rows for its budget (a request whose
        rows ended may stay in `requests` a while, waiting for its rest: a decode group)."""
        return self.requests

    @abstractmethod
    def join(self, batch: list[StageRequest], control: StageControl) -> None:
        """Add `batch`'s rows (all or none)."""

    @abstractmethod
    def step(self, control: StageControl, only: set[str] | None = None) -> bool:
        """One step of the live rows (of the requests `only`); False when none stepped."""

    @abstractmethod
    def leave(self, control: StageControl) -> Deferred | None:
        """The requests that ended, out of the set; aborted ones dropped."""

    @abstractmethod
    def drop(self, request_ids: set[str]) -> None:
        """Take these requests' rows out of the set (they failed)."""


def run_whole(stepper: RowStepper, batch: list[StageRequest], control: StageControl) -> Deferred:
    """`batch` through a running set that nothing joins, stepped until every row ended (the
    request-level policy on the same maths); each request's output goes out as it ends."""
    stepper.join(batch, control)
    outputs: dict[str, StageOutput] = {}
    while stepper.requests:
        stepped = stepper.step(control)
        part = stepper.leave(control)
        for out in part.finish(part.requests) if part is not None else []:
            outputs[out.request_id] = out
            control.deliver(out)
        if not stepped and part is None:
            break
    ended = [r for r in batch if r.request_id in outputs]
    return Deferred.done(ended, [outputs[r.request_id] for r in ended])


class Stage(ABC):
    """A model that runs batches of requests inside a worker process."""

    # the dataclass its options are typed and checked as (stage_options.py); None: a dict
    options_type: ClassVar[type | None] = None
    ranks: Ranks = Ranks()  # set by create_stage, before `load`

    def __init__(self, config: StageConfig) -> None:
        self.config = config
        self.name = config.name
        given = config.options
        self.options = typed(self.options_type, self.name, given) if self.options_type else given

    @abstractmethod
    def load(self, device: str) -> None:
        """Load weights (or build them, for `load_format=dummy`) onto `device`."""

    def validate(self, request: StageRequest) -> None:  # noqa: B027 - optional hook
        """Raise InvalidRequestError for what this stage cannot do; runs before batching."""

    @abstractmethod
    def begin(self, batch: list[StageRequest], control: StageControl) -> Deferred:
        """Run the part of `batch` that the next batch must wait for (a diffusion stage: the
        denoising loop); the rest (its decode) is `finish` of the returned part, which the
        worker runs beside the next batch. A stage with nothing to defer returns
        `Deferred.done(batch, outputs)`."""

    def stepper(self, mode: Mode) -> RowStepper | None:
        """A running set for requests of `mode` whose rows join and leave at step boundaries;
        None (the default): the mode's requests run as whole batches (`begin`)."""
        return None

    def stepped_modes(self) -> tuple[Mode, ...]:
        """The modes `stepper` runs as a running set (the worker tells the engine at start)."""
        return ()

    def precision(self) -> str | None:
        """What its model computes in, once loaded: fp8, bf16, fp16, fp32 (the worker tells the
        engine at start, `/health` says it); None: no model."""
        return None

    def cuda_graphs(self) -> tuple[tuple[str, ...], int]:
        """The buckets whose forward replays a CUDA graph, once loaded, and the bytes their
        memory pool holds (`/health`)."""
        return (), 0

    def offload(self) -> OffloadReport | None:
        """Its idle expert's offload now (`--offload idle-expert`; `/health`); None: none."""
        return None

    def execute(self, batch: list[StageRequest], control: StageControl) -> list[StageOutput]:
        """The whole batch at once: `begin`, then `finish` of the requests still live. Only
        tests call it; the worker runs the two apart (isolation.py), `finish` beside the next
        batch."""
        part = self.begin(batch, control)
        return part.finish(control.live(part.requests))

    def serve_branches(self, batch_id: int) -> None:
        """A CFG-parallel rank > 0: serve rank 0's denoiser calls of batch `batch_id` until
        rank 0 ends its denoising (`end_branches`)."""
        raise NotImplementedError(f"stage {self.name!r} has no CFG-parallel ranks")

    def end_branches(self, batch_id: int) -> None:  # noqa: B027 - optional hook
        """A CFG-parallel rank 0: batch `batch_id` needs rank 1 no more."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what `load` took."""


_KINDS = {
    "null": "vllm_omni_like.stages.null:NullStage",
    "llm": "vllm_omni_like.stages.llm.stage:LLMStage",
    "diffusion": "vllm_omni_like.stages.diffusion.stage:DiffusionStage",
}


def create_stage(config: StageConfig, ranks: Ranks = Ranks()) -> Stage:
    """Import the stage class only now, so a null stage never imports torch.

    `kind` is a built-in name or a 'package.module:Class' of the user's own Stage subclass.
    """
    module_name, _, cls_name = _KINDS.get(config.kind, config.kind).partition(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    stage = cls(config)
    stage.ranks = ranks
    return stage
