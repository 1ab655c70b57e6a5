"""`--offload idle-expert`: a two-expert model (Wan2.2-T2V/I2V-A14B) keeps one expert on the
device; the other waits in pinned host memory (bf16 A14B: 2 x 28.6 GB do not fit an 80 GB GPU
with the text encoder and a video's activations; one does).

What moves: each expert's parameters and persistent buffers (`--quantization fp8`'s FP8 weights
and scales are buffers: they move as they are). Non-persistent buffers stay on the device: the
rotary tables, and the LoRA pool's slots (lora_layers.py), which a join may write at any time.
Both experts' weights have a master copy in host memory (one pinned arena an expert); weights
never change, so leaving the device costs nothing: the tensors point at their masters again.

The swap is in place, one device buffer: the old expert's device memory is let go and the new
one's copies take it (the copy stream first waits for the compute stream's work so far, which
read the old weights). Copies run on a side CUDA stream (the copy engine), a unit at a time: the
expert's blocks (its largest `ModuleList`) each a unit, the rest one unit first. Each unit records
an event; a forward pre-hook on the unit makes the compute stream wait for it (a device-side
wait, never a host sync), so the new expert's first step starts once its first unit is in and
its later blocks arrive while the earlier ones compute. One step before a swap the policy knows
it is coming (expert_policy.py `upcoming`): the first `PREFETCH_UNITS` units are copied then,
beside the old expert's last step, into fresh memory (the in-flight copy buffer: the device
holds one expert plus those units, at most). A swap that fails (out of memory in a copy) leaves
neither expert resident and raises; the next step brings in the expert it needs anew.

On the CPU there is nothing to offload to (host memory is the device): the load refuses the
flag there. The transfer is a `Transfer` (CUDA's here; a test's fake copies on the CPU).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from vllm_omni_like.config import StageConfig
from vllm_omni_like.errors import ConfigError
from vllm_omni_like.models.adapter import Adapter
from vllm_omni_like.stages.diffusion.expert_policy import SwapPolicy
from vllm_omni_like.stages.diffusion.loop_rows import LoopRow
from vllm_omni_like.stages.diffusion.quantize import size
from vllm_omni_like.wire import Mode, OffloadReport

logger = logging.getLogger("vllm_omni_like.stages.diffusion.stage")

PREFETCH_UNITS = 2  # the head (embeddings, norms, projections) and the first block
ALIGN = 256  # bytes: each master's offset in its expert's arena


class Transfer(Protocol):
    """Where an expert's weights live and how they move (CudaTransfer; a test's fake)."""

    def masters(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of `tensors` (pinned: the copies from them run asynchronously)."""
        ...

    def idle(self, master: torch.Tensor) -> torch.Tensor:
        """What an idle expert's tensor holds (CUDA: its pinned master itself)."""
        ...

    def begin(self) -> None:
        """The copy stream waits for the compute stream's work so far."""
        ...

    def copy(self, master: torch.Tensor) -> torch.Tensor:
        """A device copy of `master`, started on the copy stream."""
        ...

    def mark(self) -> Any:
        """A mark after the copies started so far (an event on the copy stream)."""
        ...

    def wait(self, mark: Any) -> None:
        """The compute stream waits for `mark` (no host sync)."""
        ...

    def seconds(self, start: Any, end: Any) -> float | None:
        """The copy stream's time from `start` to `end`; None while `end` is not reached."""
        ...


class CudaTransfer:
    """Pinned host masters, copies on a side stream of `device`, events as marks."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.arenas: list[torch.Tensor] = []  # (held: their views are the masters)

    def masters(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One arena of exactly the tensors' bytes, page-locked with cudaHostRegister (the
        caching host allocator would round each allocation up to a power of two)."""
        arena = torch.empty(max(arena_bytes(tensors), 1), dtype=torch.uint8)
        error = torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), arena.numel(), 0)
        if int(error) != 0:
            raise RuntimeError(f"--offload: cudaHostRegister of {arena.numel()} bytes ({error})")
        weakref.finalize(arena, torch.cuda.cudart().cudaHostUnregister, arena.data_ptr())
        self.arenas.append(arena)
        return in_arena(arena, tensors)

    def idle(self, master: torch.Tensor) -> torch.Tensor:
        return master

    def begin(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def copy(self, master: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(master, device=self.device)  # (the compute stream's memory)
        with torch.cuda.stream(self.stream):
            out.copy_(master, non_blocking=True)
        # a copy let go while in flight (a prefetch an abort dropped) keeps its memory from
        # the compute stream's next allocations until the copy stream is past it
        out.record_stream(self.stream)
        return out

    def mark(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def wait(self, mark: Any) -> None:
        torch.cuda.current_stream(self.device).wait_event(mark)

    def seconds(self, start: Any, end: Any) -> float | None:
        """(Every unit prefetched: `end` was recorded before `start`, nothing was left to
        copy; each is asked, as `elapsed_time` needs both reached.)"""
        if not (start.query() and end.query()):
            return None
        return max(0.0, float(start.elapsed_time(end)) / 1000.0)


def arena_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """The bytes of an arena holding `tensors`, each at an ALIGN-byte offset."""
    return sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors)


def in_arena(arena: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` as views of the uint8 `arena` (`arena_bytes` of them), in order."""
    out, start = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        view = arena[start : start + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
        start += -(-nbytes // ALIGN) * ALIGN
    return out


@dataclass
class _Slot:
    """One tensor of an expert: where it is set, and its host master."""

    owner: torch.nn.Module
    name: str
    param: bool
    master: torch.Tensor

    def set(self, value: torch.Tensor) -> None:
        if self.param:
            getattr(self.owner, self.name).data = value  # (the same Parameter object)
        else:
            setattr(self.owner, self.name, value)  # (a registered buffer's name: the buffer)


@dataclass
class _Unit:
    """Tensors that move together; `module`'s forward waits for their copies (`mark`)."""

    module: torch.nn.Module
    slots: list[_Slot] = field(default_factory=list)
    mark: Any = None

    @property
    def nbytes(self) -> int:
        return sum(s.master.numel() * s.master.element_size() for s in self.slots)


class ExpertOffload:
    """The two experts of `adapter` (the high-noise one resident first; a row's by the
    adapter's `expert_for`), their units and the swap policy of the running set's rows."""

    def __init__(self, adapter: Adapter, transfer: Transfer, policy: SwapPolicy) -> None:
        experts = adapter.experts()
        assert len(experts) == 2 and experts[0].boundary is not None
        self.names = [e.name for e in experts]
        self.expert_for = adapter.expert_for
        self.transfer, self.policy = transfer, policy
        self.prefetch_units = PREFETCH_UNITS  # (the bench measures 0 too)
        self.units = [_units(e.model, transfer) for e in experts]
        self.resident: int | None = 0
        self.staged: dict[int, list[tuple[_Unit, list[torch.Tensor], Any]]] = {}
        self.swaps = 0
        self._timed: tuple[Any, Any] | None = None
        self._last_s: float | None = None
        for i, units in enumerate(self.units):
            for unit in units:
                unit.module.register_forward_pre_hook(self._ready_hook(i, unit))
        self._evict(1)

    # ---- the running set's side -----------------------------------------------------------
    def pick(self, rows: Sequence[LoopRow], active: list[int]) -> tuple[list[int], int, list[int]]:
        """The rows of `active` that step now (those of the expert chosen), the expert and every
        active row's need; the expert made resident (its copies under way) and, where the step
        after this one will swap, the next expert's first units prefetched."""
        needs = [self.expert_for(float(rows[i].state.timestep)) for i in active]
        chosen = self.policy.choose(self.resident, needs)
        later = []
        for i, need in zip(active, needs, strict=True):
            if need != chosen:
                later.append(need)
            elif (upcoming := _next_timestep(rows[i])) is not None:
                later.append(self.expert_for(upcoming))
        nxt = self.policy.upcoming(self.resident, chosen, needs, later)
        self.swap_to(chosen)
        if nxt is not None:
            self.prefetch(nxt)
        return [i for i, n in zip(active, needs, strict=True) if n == chosen], chosen, needs

    def stepped(self, before: int | None, chosen: int, needs: list[int]) -> None:
        """The step of `chosen`'s rows was committed (`before`: the resident expert then)."""
        self.policy.stepped(before, chosen, needs)

    def release(self) -> None:
        """Drop a prefetch no step took (its rows aborted or the set drained)."""
        self.staged.clear()

    # ---- the swap ---------------------------------------------------------------------------
    def prefetch(self, expert: int) -> None:
        """Start copying `expert`'s first units into fresh device memory (beside this step)."""
        if expert == self.resident or expert in self.staged:
            return
        self.transfer.begin()
        staged = []
        for unit in self.units[expert][: self.prefetch_units]:
            copies = [self.transfer.copy(s.master) for s in unit.slots]
            staged.append((unit, copies, self.transfer.mark()))
        self.staged[expert] = staged

    def swap_to(self, expert: int) -> None:
        """Make `expert` the resident one: the other's device memory let go, then its units'
        copies started (each forward of a unit waits for its own); nothing waits on the host."""
        if expert == self.resident:
            return
        self._read_last()
        if self.resident is not None:
            self._evict(self.resident)
        self.resident = None
        staged = {id(unit): (copies, mark) for unit, copies, mark in self.staged.pop(expert, [])}
        self.staged.clear()
        self.transfer.begin()
        start = self.transfer.mark()
        try:
            for unit in self.units[expert]:
                copies, mark = staged.pop(id(unit), (None, None))
                if copies is None:
                    copies = [self.transfer.copy(s.master) for s in unit.slots]
                    mark = self.transfer.mark()
                for slot, copy in zip(unit.slots, copies, strict=True):
                    slot.set(copy)
                unit.mark = mark
        except BaseException:
            self._evict(expert)  # (neither resident: the next step brings its expert in)
            raise
        self.resident, self.swaps = expert, self.swaps + 1
        self._timed = (start, self.units[expert][-1].mark)

    def _evict(self, expert: int) -> None:
        for unit in self.units[expert]:
            unit.mark = None
            for slot in unit.slots:
                slot.set(self.transfer.idle(slot.master))

    def _ready_hook(self, expert: int, unit: _Unit) -> Callable[..., None]:
        def ready(module: torch.nn.Module, args: Any) -> None:
            if self.resident != expert:
                raise RuntimeError(
                    f"--offload idle-expert: {self.names[expert]} was called while it waits "
                    "in host memory"
                )
            if unit.mark is not None:
                self.transfer.wait(unit.mark)
                unit.mark = None

        return ready

    # ---- what it says -----------------------------------------------------------------------
    def _read_last(self) -> None:
        """The last swap's copy time, once its copies are done (read without waiting)."""
        timed = self._timed
        if timed is not None:
            seconds = self.transfer.seconds(*timed)
            if seconds is not None:
                self._last_s = seconds

    def device_bytes(self) -> int:
        """(Read from another thread too - the worker's report: copies of what it walks.)"""
        resident = self.resident
        held = [] if resident is None else self.units[resident]
        staged = [unit for units in tuple(self.staged.values()) for unit, _, _ in units]
        return sum(u.nbytes for u in held + staged)

    def report(self) -> OffloadReport:
        self._read_last()
        return OffloadReport(
            mode="idle-expert",
            resident=None if self.resident is None else self.names[self.resident],
            swaps=self.swaps,
            last_swap_s=self._last_s,
            device_bytes=self.device_bytes(),
            host_bytes=sum(u.nbytes for units in self.units for u in units),
        )


def _next_timestep(row: LoopRow) -> float | None:
    """The row's timestep after this step (None: this is its last)."""
    state = row.state
    if state.index + 1 >= state.schedule.iterations:
        return None
    return float(state.schedule.timesteps[state.index + 1])


def _units(model: torch.nn.Module, transfer: Transfer) -> list[_Unit]:
    """`model`'s units in the order a forward uses them: the tensors outside its blocks (its
    largest ModuleList child) first, then each block; each tensor's master made."""
    lists = [m for m in model.children() if isinstance(m, torch.nn.ModuleList)]
    blocks = max(lists, key=len) if lists else torch.nn.ModuleList()
    inside = {id(m) for block in blocks for m in block.modules()}
    saved = {id(t) for t in model.state_dict(keep_vars=True).values()}
    head = _Unit(model, _slots([m for m in model.modules() if id(m) not in inside], saved))
    units = [head] + [_Unit(block, _slots(list(block.modules()), saved)) for block in blocks]
    units = [u for u in units if u.slots]
    every = [s for u in units for s in u.slots]
    with torch.inference_mode(False), torch.no_grad():
        masters = transfer.masters([s.master for s in every])
    for slot, master in zip(every, masters, strict=True):
        slot.master = master
    return units


def _slots(modules: list[torch.nn.Module], saved: set[int]) -> list[_Slot]:
    """The parameters and persistent buffers (those in the model's state dict: `saved`, their
    ids) that `modules` own, each tensor once."""
    slots, seen = [], set()
    for m in modules:
        kept: list[tuple[str, torch.Tensor, bool]]
        kept = [(n, t, True) for n, t in m.named_parameters(recurse=False)]
        kept += [(n, t, False) for n, t in m.named_buffers(recurse=False)]
        for name, tensor, param in kept:
            if id(tensor) in saved and id(tensor) not in seen:
                seen.add(id(tensor))
                slots.append(_Slot(m, name, param, tensor.detach()))
    return slots


def build(
    config: StageConfig, adapter: Adapter, device: torch.device, pipeline_modes: set[Mode]
) -> ExpertOffload | None:
    """The stage's offload (None: `--offload none`), refused where it cannot run: a model of
    one denoiser, a device that is not CUDA, a mode the pipeline's own call runs (it would
    call both experts)."""
    if config.offload == "none":
        return None
    flag, experts = f"stage {config.name!r}: --offload {config.offload}", adapter.experts()
    if len(experts) < 2 or experts[0].boundary is None:
        raise ConfigError(
            f"{flag} keeps the idle one of two experts (Wan2.2-T2V/I2V-A14B) in host memory; "
            f"this model has one denoiser ({experts[0].name}): use --offload none"
        )
    check_device(config, device)
    if pipeline_modes:
        raise ConfigError(
            f"{flag}: {', '.join(sorted(pipeline_modes))} would run the pipeline's own call, "
            "which calls both experts; the offload runs our own loop's modes only"
        )
    offload = ExpertOffload(adapter, CudaTransfer(device), SwapPolicy())
    torch.cuda.empty_cache()  # (the idle expert's device memory back to the device)
    return offload


def check_device(config: StageConfig, device: torch.device) -> None:
    """Refuse `--offload idle-expert` off CUDA (before anything loads)."""
    if config.offload != "none" and device.type != "cuda":
        raise ConfigError(
            f"stage {config.name!r}: --offload {config.offload} needs a CUDA device: on "
            f"{device.type} the host memory is the device's, there is nowhere to offload to "
            "(use --offload none)"
        )


def describe(offload: ExpertOffload, device: torch.device) -> str:
    """The start-up log's line: where each expert is, and the device memory held."""
    report = offload.report()
    idle = offload.names[1 - (offload.resident or 0)]
    held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    return (
        f"--offload idle-expert: {report.resident} on {device} ({size(report.device_bytes)}), "
        f"{idle} in pinned host memory ({size(report.host_bytes)} of masters for both); "
        f"device memory allocated {size(held)}"
    )
