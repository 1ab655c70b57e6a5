"""First-Block Cache for our own loop's rows: each row decides at each step, from its own first
block's residual, whether to run the denoiser's other blocks or reuse what they added before.

The family's adapter describes its blocks (models/block_stack.py); here each block of the
stack is wrapped (after compiling: a compiled block stays one graph, the wrappers run eager).
Outside a forward of our loop (`forward`) the wrappers only call their block. Inside one:
1. the first block runs on every model row; each row's conditional branch measures the change
   of its residual (`mean|r - r_ref| / mean|r_ref|`, r_ref: its residual when it last ran the
   rest) and the row reuses where that is under its threshold and it has what it reuses
   (`sync`: the change read on the host, one read a step; `lagged`: the change of the row's
   step before, copied without a wait, so the host never waits for the device here);
2. a row's branches follow its conditional branch's decision (its unconditional branch too,
   where it runs in a forward of its own);
3. the rows that compute run the other blocks as a sub-batch, padded to a compiled bucket
   (nothing compiles after the warm-up); where all compute, the forward is the uncached one;
4. the last block gives every row its output: a reusing row's first-block output plus its
   cached residual, a computing row's own (whose residual is kept for the next reuse).
A row's cache is its own (`RowCache`, on its LoopRow): a row that joins starts empty, a step
that raises puts it back (`save`, `restore`), and what a row computes does not depend on its
peers' decisions but through the sub-batch's size (a matmul's rounding).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_omni_like.errors import ConfigError
from vllm_omni_like.models.block_stack import BlockStack
from vllm_omni_like.stages.diffusion.acceleration import bucket_for
from vllm_omni_like.stages.diffusion.row_tensors import row_index

_EPS = 1e-12  # (a residual of zeros: no division by zero)


@dataclass
class RowCache:
    """One row's cache: its threshold, its conditional branch's first-block residual when it
    last ran the rest, the rest's residual of each branch (0: conditional, 1: unconditional),
    this step's decision, and (lagged) the change its last step measured."""

    threshold: float
    branches: int = 1  # 2: a row with guidance
    reference: torch.Tensor | None = None
    rest: dict[int, torch.Tensor] = field(default_factory=dict)
    compute: bool = True
    steps: int = 0  # the steps it decided (its conditional branch's forwards)
    change: tuple[torch.Tensor, int, Any] | None = None  # (host values, its position, event)

    def save(self) -> tuple[Any, ...]:
        return self.reference, dict(self.rest), self.compute, self.change, self.steps

    def restore(self, saved: tuple[Any, ...]) -> None:
        self.reference, self.rest, self.compute, self.change, self.steps = saved

    def lagged_change(self) -> float | None:
        """The change the row's step before measured (waiting for it only if the host ran
        more than a step ahead of the device); None: none measured."""
        if self.change is None:
            return None
        values, at, event = self.change
        if event is not None:
            event.synchronize()
        return float(values[at])


Slot = tuple[RowCache, int]  # a model row's row and branch


@dataclass
class _Pass:
    """One forward's state between its blocks."""

    slots: list[Slot | None]  # each model row's (None: bucket padding)
    mode: str = "all"  # all compute | none does | some do (a sub-batch)
    index: torch.Tensor | None = None  # the computing model rows, padded to a bucket
    computing: list[int] = field(default_factory=list)
    reusing: list[int] = field(default_factory=list)
    head: dict[str, Any] = field(default_factory=dict)  # the first block's outputs
    gathered: dict[int, torch.Tensor] = field(default_factory=dict)  # per-row args, by id

    def row(self, i: int) -> RowCache:
        slot = self.slots[i]
        assert slot is not None  # (a model row of a row, not padding)
        return slot[0]


class FirstBlockCache:
    """The stack's wrappers and the forward they are in; counts the block evaluations."""

    def __init__(self, stack: BlockStack, buckets: tuple[int, ...], lagged: bool) -> None:
        self.stack, self.buckets, self.lagged = stack, buckets, lagged
        self.depth = len(stack.blocks)
        if self.depth < 2:
            raise ConfigError("--cache first-block needs a denoiser of two blocks or more")
        self.active: _Pass | None = None
        self.evaluations = 0  # block evaluations a model row would have run, uncached
        self.saved = 0  # those skipped
        # a benchmark's fixed decisions (random weights make the residual's test arbitrary):
        # whether a row that could reuse computes, given the row (None: its threshold decides)
        self.forced: Callable[[RowCache], bool] | None = None
        position = 0
        for blocks in stack.lists:
            for i in range(len(blocks)):
                blocks[i] = CachedBlock(blocks[i], position, self)
                position += 1

    @property
    def saved_share(self) -> float:
        return self.saved / self.evaluations if self.evaluations else 0.0

    @contextmanager
    def unwrapped(self) -> Iterator[None]:
        """The stack's own blocks back in their lists meanwhile (a benchmark's other cache)."""
        wrapped = [list(blocks) for blocks in self.stack.lists]
        for blocks in self.stack.lists:
            for i in range(len(blocks)):
                blocks[i] = blocks[i].block
        try:
            yield
        finally:
            for blocks, kept in zip(self.stack.lists, wrapped, strict=True):
                for i, block in enumerate(kept):
                    blocks[i] = block

    @contextmanager
    def forward(self, slots: list[Slot | None]) -> Iterator[None]:
        """A forward of our loop over model rows `slots` (padding: None)."""
        self.active = _Pass(slots)
        try:
            yield
        finally:
            self.active = None

    # ---- the blocks --------------------------------------------------------------------------
    def call(self, block: Any, position: int, args: tuple, kwargs: dict) -> Any:
        run = self.active
        if run is None:
            return block(*args, **kwargs)
        named = self._named(args, kwargs)
        if position == 0:
            return self._head(run, block, named)
        if run.mode == "none":  # every row reuses: the rest of the blocks are skipped
            return self._returns({k: named[k] for k in self.stack.returns})
        if run.mode == "some":
            named = self._gather(run, named, carried=position == 1)
        out = block(**named)
        if position == self.depth - 1:
            return self._tail(run, self._outputs(out))
        return out

    def _head(self, run: _Pass, block: Any, named: dict[str, Any]) -> Any:
        before = named[self.stack.hidden]
        out = self._outputs(block(**named))
        after = out[self.stack.hidden]
        residual = after - before
        self._decide(run, residual)
        run.head = out
        real = [s for s in run.slots if s is not None]
        self.evaluations += len(real) * self.depth
        self.saved += len(run.reusing) * (self.depth - 1)
        if run.mode == "all":
            return self._returns(out)
        if run.mode == "some":
            run.index = _padded_index(run.computing, self.buckets, after.device)
        reused = dict(out)
        reused[self.stack.hidden] = self._with_rest(run, after)
        return self._returns(reused)

    def _tail(self, run: _Pass, out: dict[str, Any]) -> Any:
        """Every row's output of the stack; the computing rows' residuals kept."""
        hidden = self.stack.hidden
        head = run.head[hidden]
        if run.mode == "all":
            self._keep(run, list(range(len(run.slots))), out[hidden] - head)
            return self._returns(out)
        count = len(run.computing)
        where = row_index(run.computing, head.device)
        computed = out[hidden][:count]
        self._keep(run, run.computing, computed - head[where])
        full = dict(run.head)
        full[hidden] = self._with_rest(run, head).index_copy(0, where, computed)
        for name in self.stack.returns:  # (the other streams: unused after the stack)
            if name != hidden and full[name] is not None and out[name] is not None:
                full[name] = full[name].index_copy(0, where, out[name][:count])
        return self._returns(full)

    # ---- the decision ------------------------------------------------------------------------
    def _decide(self, run: _Pass, residual: torch.Tensor) -> None:
        """Each row's decision, taken by its conditional branch; the model rows that compute
        and those that reuse (padding follows the others: computed only where all are)."""
        heads = [i for i, s in enumerate(run.slots) if s is not None and s[1] == 0]
        changes = self._changes(run, heads, residual)
        for i in heads:
            row = run.row(i)
            change = changes.get(i)
            ready = len(row.rest) == row.branches and row.reference is not None
            row.compute = not (ready and change is not None and change < row.threshold)
            if ready and self.forced is not None:
                row.compute = self.forced(row)
            row.steps += 1
            if row.compute:  # (a copy: a view would hold the whole batch's tensor alive)
                row.reference = residual[i].clone()
        for i, slot in enumerate(run.slots):
            if slot is not None:
                (run.computing if slot[0].compute else run.reusing).append(i)
        if not run.reusing:
            run.mode, run.computing = "all", list(range(len(run.slots)))
        elif not run.computing:
            run.mode = "none"
        else:
            run.mode = "some"

    def _changes(self, run: _Pass, heads: list[int], residual: torch.Tensor) -> dict[int, float]:
        """Each measured row's change: this step's (sync) or its step before's (lagged)."""
        refs: dict[int, torch.Tensor] = {}
        for i in heads:  # (a reference of another shape - a Z-Image row's text bucket - none)
            ref = run.row(i).reference
            if ref is not None and ref.shape == residual.shape[1:]:
                refs[i] = ref
        measured = list(refs)
        found: dict[int, float] = {}
        if self.lagged:
            for i in heads:
                value = run.row(i).lagged_change()
                if value is not None:
                    found[i] = value
                run.row(i).change = None  # (until this step's is measured)
        if not measured:
            return found
        index = row_index(measured, residual.device)
        now = residual[index].float().flatten(1)
        ref = torch.stack([refs[i] for i in measured]).float().flatten(1)
        change = (now - ref).abs().mean(1) / ref.abs().mean(1).clamp_min(_EPS)
        if not self.lagged:
            return dict(zip(measured, change.tolist(), strict=True))  # (the step's one read)
        host = change.to("cpu", non_blocking=True)
        event = torch.cuda.Event() if change.device.type == "cuda" else None
        if event is not None:
            event.record()
        for at, i in enumerate(measured):
            run.row(i).change = (host, at, event)
        return found

    # ---- rows: reuse, keep, gather -----------------------------------------------------------
    def _with_rest(self, run: _Pass, head: torch.Tensor) -> torch.Tensor:
        """`head` plus each reusing row's cached residual (the others as they are)."""
        rests = [run.row(i).rest[_branch(run, i)] for i in run.reusing]
        where = row_index(run.reusing, head.device)
        return head.index_add(0, where, torch.stack(rests).to(head.dtype))

    def _keep(self, run: _Pass, rows: list[int], residual: torch.Tensor) -> None:
        for j, i in enumerate(rows):
            slot = run.slots[i]
            if slot is not None:  # (a copy, as the reference)
                slot[0].rest[slot[1]] = residual[j].clone()

    def _gather(self, run: _Pass, named: dict[str, Any], carried: bool) -> dict[str, Any]:
        """A block's arguments for the computing rows: the per-row ones (gathered once a
        forward), and the carried ones where they come from the first block."""
        assert run.index is not None
        names = set(self.stack.per_row) | (set(self.stack.returns) if carried else set())
        out = dict(named)
        for name in names:
            value = named.get(name)
            if isinstance(value, torch.Tensor):
                if id(value) not in run.gathered:
                    run.gathered[id(value)] = value.index_select(0, run.index)
                out[name] = run.gathered[id(value)]
        return out

    # ---- a block call's arguments and results ------------------------------------------------
    def _named(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        named = dict(zip(self.stack.params, args, strict=False))
        if len(args) > len(self.stack.params):
            raise TypeError(f"a block called with {len(args)} positional arguments")
        named.update(kwargs)
        return named

    def _outputs(self, out: Any) -> dict[str, Any]:
        names = self.stack.returns
        return {names[0]: out} if len(names) == 1 else dict(zip(names, out, strict=True))

    def _returns(self, values: dict[str, Any]) -> Any:
        names = self.stack.returns
        return values[names[0]] if len(names) == 1 else tuple(values[n] for n in names)


class CachedBlock(torch.nn.Module):
    """A block of the stack, called through its cache."""

    cache: FirstBlockCache

    def __init__(self, block: Any, position: int, cache: FirstBlockCache) -> None:
        super().__init__()
        self.block = block
        self.position = position
        self.__dict__["cache"] = cache  # (not a submodule: no state of the model's)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.cache.call(self.block, self.position, args, kwargs)


def cache_pass(
    cache: FirstBlockCache | None, slots: list[tuple[RowCache | None, int]] | None, pad: int
) -> AbstractContextManager[None]:
    """The step cache's forward over these model rows (each one's cache and branch) and `pad`
    rows of padding; nothing without a cache."""
    if cache is None or slots is None:
        return nullcontext()
    return cache.forward([(c, b) if c is not None else None for c, b in slots] + [None] * pad)


def _branch(run: _Pass, i: int) -> int:
    slot = run.slots[i]
    return 0 if slot is None else slot[1]


def _padded_index(rows: list[int], buckets: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The rows, the last repeated up to the compiled bucket of their count."""
    pad = bucket_for(len(rows), buckets) - len(rows)
    return row_index(rows + [rows[-1]] * pad, device)
