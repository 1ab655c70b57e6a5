"""Our own loop's rows: each steps with its own schedule; a step is computed, then committed.

Groups of rows join at a step boundary, every row steps with its own schedule, and a request
leaves when its rows have ended (or it was aborted).

A step is computed, then its step-point faults fire, then it is committed: a step that raises
leaves the set as it was before it (each row's schedule position, multistep history and step
cache are put back), so the worker can bisect it (`step(only=...)` steps a subset). What a row
computes depends on its own inputs only, so a request's latents are the same whether it ran alone or
joined a busy set at step k (tests/stages/diffusion/test_running_set.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from vllm_omni_like.models.row_conditions import Conditioning
from vllm_omni_like.stages.diffusion.loop_rows import LoopRow, Plan
from vllm_omni_like.stages.diffusion.row_tensors import (
    Text,
    cat_named,
    cat_rows,
    row_index,
    take,
    take_named,
)
from vllm_omni_like.stages.diffusion.step import DenoiseLoop
from vllm_omni_like.wire import StageRequest


@dataclass
class Left:
    """Requests whose rows all ended: their rows' latents (in row order) and seeds."""

    requests: list[StageRequest]
    latents: torch.Tensor
    seeds: list[int]


def _text_rows(text: Text) -> int:
    return int(next(iter(text.values())).shape[0] if isinstance(text, dict) else text.shape[0])


class DenoiseSet:
    """The set's tensors stay inference tensors through joins, leaves and removals (each runs
    under `torch.inference_mode`, whoever calls it): a compiled model guards on its inputs'
    dispatch keys, so a plain tensor where the warm-up saw an inference tensor (the latents of
    a set without guidance, passed to the model as they are) would make it compile again."""

    def __init__(self, loop: DenoiseLoop) -> None:
        self.loop = loop
        self.rows: list[LoopRow] = []
        self.text: Text | None = None
        self.latents: torch.Tensor | None = None
        # rows from an image: each row's own conditioning, kept as the latents are (else None)
        self.conditioning: Conditioning | None = None
        self._plan: Plan | None = None

    @property
    def empty(self) -> bool:
        return not self.rows

    @property
    def requests(self) -> list[StageRequest]:
        """The requests in the set, in the order they joined (each once)."""
        return _distinct(row.request for row in self.rows)

    @torch.inference_mode()
    def join(
        self,
        rows: list[LoopRow],
        text: Text,
        latents: torch.Tensor,
        conditioning: Conditioning | None = None,
    ) -> None:
        """Add a group's rows (`loop.rows`, `loop.noise` and `loop.conditions` made them) at
        the step boundary, each holding its LoRA adapters' pool slots (written there now if
        not resident) until it leaves; nothing joins where one cannot."""
        self._hold(rows)
        try:  # (the device may run out of memory here: the rows let their slots go then)
            if self.text is not None and self.latents is not None:
                base = _text_rows(self.text)
                joined = cat_rows(self.text, text)
                stacked = torch.cat([self.latents, latents.to(self.latents.dtype)])
                assert (self.conditioning is None) == (conditioning is None)  # (one family's)
                if self.conditioning is not None and conditioning is not None:
                    self.conditioning = cat_named(self.conditioning, conditioning)
                self.text, self.latents = joined, stacked
                for row in rows:  # its text rows follow the set's
                    row.text += base
                    row.negative = None if row.negative is None else row.negative + base
            else:
                self.text, self.latents, self.conditioning = text, latents, conditioning
        except BaseException:
            self.let_go(rows)
            raise
        self.rows += rows
        self._plan = None

    def step(
        self,
        live: set[str],
        check: Callable[[list[StageRequest]], None] | None = None,
        only: set[str] | None = None,
    ) -> dict[str, tuple[int, int]]:
        """One step of every live row that has steps left (of those in `only`, if given);
        `check(requests)` runs between computing the step and committing it (the step's
        faults), and a step that raises is not committed. Each stepped request's (step, total)
        (its rows share their schedule); empty: no row stepped."""
        assert self.latents is not None and self.text is not None
        active = [
            i
            for i, r in enumerate(self.rows)
            if not r.state.done
            and r.request.request_id in live
            and (only is None or r.request.request_id in only)
        ]
        if not active:
            return {}
        offload, before = self.loop.offload, None
        if offload is not None:  # (one expert on the device: its rows step, the others wait)
            before = offload.resident
            active, chosen, needs = offload.pick(self.rows, active)
        plan = self._plan
        if plan is None or plan.active != active:
            plan = self.loop.plan(self.rows, active, self.text, self.latents, self.conditioning)
        saved = [(r.state.index, dict(r.state.history), _cache_of(r)) for r in plan.group]
        try:
            part = self.latents if plan.index is None else self.latents[plan.index]
            stepped = self.loop.step(plan, part)
            if check is not None:
                check(_distinct(r.request for r in plan.group))
        except BaseException:
            for r, (index, history, cache) in zip(plan.group, saved, strict=True):
                r.state.index, r.state.history = index, history
                if r.cache is not None and cache is not None:  # (its step cache as it was)
                    r.cache.restore(cache)
            raise
        if plan.index is None:
            self.latents = stepped
        else:
            self.latents = self.latents.to(stepped.dtype)
            self.latents[plan.index] = stepped
        self._plan = plan
        if offload is not None:
            offload.stepped(before, chosen, needs)
        return {
            r.request.request_id: (r.state.index, r.state.schedule.iterations) for r in plan.group
        }

    def first_rows(self) -> dict[str, int]:
        """Each request's first row in the set."""
        first: dict[str, int] = {}
        for i, row in enumerate(self.rows):
            first.setdefault(row.request.request_id, i)
        return first

    @torch.inference_mode()
    def leave(self, live: set[str]) -> Left | None:
        """Take out the rows of requests that ended (returned, with their latents) or are no
        longer live (dropped)."""
        pending = {r.request.request_id for r in self.rows if not r.state.done}
        ended = ({r.request.request_id for r in self.rows} & live) - pending
        keep = [i for i, r in enumerate(self.rows) if r.request.request_id in live - ended]
        out = [i for i, r in enumerate(self.rows) if r.request.request_id in ended]
        if len(keep) == len(self.rows):
            return None
        assert self.latents is not None and self.text is not None
        left = None
        if out:
            index = row_index(out, self.latents.device)
            requests = _distinct(self.rows[i].request for i in out)
            left = Left(requests, self.latents[index], [self.rows[i].seed for i in out])
        self._keep(keep)
        return left

    @torch.inference_mode()
    def remove(self, request_ids: set[str]) -> None:
        """Take these requests' rows out (their latents dropped)."""
        keep = [i for i, r in enumerate(self.rows) if r.request.request_id not in request_ids]
        if len(keep) < len(self.rows):
            self._keep(keep)
        if self.loop.offload is not None:  # (a prefetch for the rows removed: dropped)
            self.loop.offload.release()

    def _hold(self, rows: list[LoopRow]) -> None:
        pool = self.loop.loras
        if pool is None:
            return
        try:
            for row in rows:
                row.lora = pool.acquire(row.request.params.loras)
        except BaseException:
            for row in rows:
                pool.release(row.lora)
                row.lora = ()
            raise

    def let_go(self, rows: list[LoopRow] | None = None) -> None:
        """`rows`' LoRA slots (default: every row's) let go: they hold none after."""
        if self.loop.loras is not None:
            for row in self.rows if rows is None else rows:
                self.loop.loras.release(row.lora)
                row.lora = ()

    def _keep(self, keep: list[int]) -> None:
        """Only the rows `keep`, their text compacted (the set's text never outgrows it); the
        others' LoRA slots let go."""
        assert self.latents is not None and self.text is not None
        rows = [self.rows[i] for i in keep]
        self.let_go([self.rows[i] for i in set(range(len(self.rows))) - set(keep)])
        self._plan = None
        if not rows:
            self.rows, self.text, self.latents, self.conditioning = [], None, None, None
            if self.loop.offload is not None:  # (the set drained: no prefetch held)
                self.loop.offload.release()
            return
        used = sorted({r.text for r in rows} | {r.negative for r in rows if r.negative is not None})
        where = {old: new for new, old in enumerate(used)}
        for row in rows:
            row.text = where[row.text]
            row.negative = None if row.negative is None else where[row.negative]
        device = self.latents.device
        self.text = take(self.text, used, device)
        self.latents = self.latents[row_index(keep, device)]
        if self.conditioning is not None:
            self.conditioning = take_named(self.conditioning, keep, device)
        self.rows = rows


def _cache_of(row: LoopRow) -> tuple | None:
    return None if row.cache is None else row.cache.save()


def _distinct(requests: Iterable[StageRequest]) -> list[StageRequest]:
    seen: dict[str, StageRequest] = {}
    for r in requests:
        seen.setdefault(r.request_id, r)
    return list(seen.values())
