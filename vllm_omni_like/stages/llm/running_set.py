"""The LLM stage's running set: requests join at a step boundary and leave when their text ends.

The stage's side of the running-set contract (stages/base.py `RowStepper`): requests join the
stage's `DecodeSet` at a step boundary and leave as soon as their text has ended, so a
short rewrite is not padded until a long chat reply ends. A whole batch is a set that nothing
joins (`LLMStage.begin`), so both run the same loop.

A row whose way in fails (its template, tokenization or constraint) ends alone at its join,
its output sent at once; a row whose constraint or detokenization fails mid-way ends alone at
that step (400 when the request caused it, 500 otherwise)."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from vllm_omni_like.errors import InvalidRequestError, is_fatal_device_error
from vllm_omni_like.outputs import StageOutput
from vllm_omni_like.stages.base import Deferred, RowStepper, StageControl
from vllm_omni_like.stages.llm.sampling import RowSampling
from vllm_omni_like.stages.llm.token_batch import DecodeSet
from vllm_omni_like.stages.llm.token_rules import RowDecoder, RowResult
from vllm_omni_like.stages.torch_utils import BatchDimProbe
from vllm_omni_like.wire import StageRequest


class RowSource(Protocol):
    """What the set asks of its stage (`LLMStage`): its model and decoder, how a request's row
    gets in (tokens, constraint, sampling) and what an ended row gives out."""

    name: str
    model: torch.nn.Module
    decoder: RowDecoder
    device: torch.device
    probe: BatchDimProbe

    def admit(self, request: StageRequest, control: StageControl) -> tuple[list[int], Any]: ...

    def sampling(self, request: StageRequest, guide: Any, prompt_tokens: int) -> RowSampling: ...

    def output(self, r: StageRequest, res: RowResult) -> StageOutput: ...


class LLMRows(RowStepper):
    def __init__(self, stage: RowSource) -> None:
        self.stage = stage
        self.set = DecodeSet(stage.model, stage.decoder, stage.device)
        self.joined: dict[str, StageRequest] = {}  # in the set, by request id
        self.failed: dict[str, StageOutput] = {}  # ended at their join, to leave at the next

    @property
    def requests(self) -> list[StageRequest]:
        return list(self.joined.values())

    def join(self, batch: list[StageRequest], control: StageControl) -> None:
        stage = self.stage
        entries: list[tuple[str, list[int], RowSampling]] = []
        failed: dict[str, StageOutput] = {}
        for r in batch:
            try:
                ids, guide = stage.admit(r, control)
                if not ids:
                    raise InvalidRequestError(
                        "the prompt is empty once tokenized", stage=stage.name, param="prompt"
                    )
            except Exception as exc:
                if is_fatal_device_error(exc):
                    raise
                failed[r.request_id] = StageOutput.from_error(r.request_id, exc, stage.name)
                continue
            entries.append((r.request_id, ids, stage.sampling(r, guide, len(ids))))
        if entries:
            stage.probe.reset()
            self.set.join(entries)  # (all or none: it may raise, nothing joined)
            control.saw_model_batch(stage.probe.max_seen)
        for r in batch:
            self.joined[r.request_id] = r
        for output in failed.values():
            control.deliver(output)  # its waiter wakes now, before any step
        self.failed.update(failed)

    def step(self, control: StageControl, only: set[str] | None = None) -> bool:
        live = {r.request_id for r in control.live(self.requests)}
        joined = self.joined

        def check(keys: list[str]) -> None:
            control.faults.fire("step", [joined[k] for k in keys])

        def fault(point: str, key: str) -> None:
            control.faults.fire(point, [joined[key]])

        self.stage.probe.reset()
        stepped = self.set.step(live, check, fault, only)
        if stepped is None:
            return False
        control.saw_model_batch(self.stage.probe.max_seen)
        requests = [joined[k] for k in stepped.progress]
        step = max(at for at, _ in stepped.progress.values())
        total = max(of for _, of in stepped.progress.values())
        control.step(requests, step, total, dict(stepped.deltas), stepped.progress, fire=False)
        return True

    def leave(self, control: StageControl) -> Deferred | None:
        live = {r.request_id for r in control.live(self.requests)}
        outputs = {k: self.stage.output(self.joined[k], res) for k, res in self.set.leave(live)}
        outputs.update({k: out for k, out in self.failed.items() if k in live})
        self.failed.clear()
        ended = [r for k, r in self.joined.items() if k in outputs]
        for key in [k for k in self.joined if k not in live or k in outputs]:
            del self.joined[key]  # (aborted ones: dropped)
        if not ended:
            return None
        return Deferred.done(ended, [outputs[r.request_id] for r in ended])

    def drop(self, request_ids: set[str]) -> None:
        self.set.remove(request_ids)
        for key in request_ids:
            self.joined.pop(key, None)
            self.failed.pop(key, None)
