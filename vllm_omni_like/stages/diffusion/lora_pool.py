"""The device pool of LoRA adapters: `--max-loras` slots, least recently used evicted, none a
running row uses; what each row of a forward uses, as the batch's device tensors.

An adapter is read and checked once on the host (lora_files.py; a registered one at start-up,
where a problem refuses the start, a `--lora-dir` one when a request first names it, where it
fails that request alone) and kept there, a few at a time; it reaches the device when a row
that uses it joins the set: written in place into a free slot (or the least recently used one
no row holds), between two steps, so the replica never stops and no graph is compiled again.
A row holds its slots from its join until it leaves (`acquire` / `release`); slot 0 is no
adapter (zeros).

Over the ranks of a replica (sequence-parallel, CFG-parallel, both) every rank holds the pool
(parallel/rank_link.py's `Replicated`): rank 0 alone reads files and decides which adapter goes
where; each slot it writes is copied into the others' as it is written (its sequence-parallel
group's, its CFG-parallel partner's, which passes it on to its own group), and each forward's
rows (slots, scales) travel with the forward."""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from vllm_omni_like.config import StageConfig
from vllm_omni_like.errors import ConfigError, InvalidRequestError, UnavailableError
from vllm_omni_like.loras import LoraSpec, resolve
from vllm_omni_like.models.adapter import Adapter
from vllm_omni_like.models.columns import to_device
from vllm_omni_like.params import LoraRef
from vllm_omni_like.stages.diffusion.lora_files import AdapterWeights, LoraError, read_adapter
from vllm_omni_like.stages.diffusion.lora_kernels import choose
from vllm_omni_like.stages.diffusion.lora_layers import LoraContext, LoraLinear, Target, wrap
from vllm_omni_like.stages.diffusion.lora_reads import Key, LoraReads, key_of

logger = logging.getLogger("vllm_omni_like.stages.diffusion.stage")
Selection = tuple[tuple[int, float], ...]  # a row's (slot, scale) of each adapter it uses
LoraRows = tuple[torch.Tensor, torch.Tensor]  # a forward's model rows' slots and scales
HOST_KEPT = 2  # adapters kept read on the host: this many times the pool's slots


class LoraPool:
    def __init__(
        self,
        specs: tuple[LoraSpec, ...],
        directory: str | None,
        targets: dict[str, Target],
        known: set[str],
        reader: tuple[type, tuple[str, ...]],  # the pipeline's class (its converter), experts
        sizes: tuple[int, int, int],  # max_loras, max_lora_rank, max_loras_per_request
        context: LoraContext,
    ) -> None:
        self.specs, self.directory = specs, directory
        self.targets, self.known, self.reader = targets, known, reader
        self.max_loras, self.max_rank, self.per_row = sizes
        self.context = context
        unique = {id(t.layer): t.layer for t in targets.values()}  # (a fused one: once)
        self.layers: list[LoraLinear] = list(unique.values())
        self.slots: OrderedDict[str, int] = OrderedDict()  # resident, least recently used first
        self.free = list(range(self.max_loras, 0, -1))
        self.pins: Counter[int] = Counter()
        self.version: dict[int, Key] = {}  # each written slot's file, as it was read
        self.stale: set[int] = set()  # slots of a file changed since, until no row holds them
        self.reads = LoraReads(self._read_file, HOST_KEPT * self.max_loras)
        self.loads = 0  # adapters written to the device (the benchmark's cold loads)
        self.senders: list[Callable[[int], None]] = []  # (copies into the other ranks')

    # ---- names to weights ------------------------------------------------------------------
    def spec(self, name: str) -> LoraSpec:
        found = resolve(name, self.specs, self.directory)
        if found is None:
            raise InvalidRequestError(f"unknown LoRA adapter {name!r}", param="lora")
        return found

    def key(self, name: str) -> Key:
        """Adapter `name`'s file as it is now (LoraError where it is gone)."""
        return key_of(self.spec(name))

    def read(self, name: str) -> AdapterWeights:
        """Adapter `name` read and checked (kept on the host while its file is unchanged; a
        read under way on the read thread is waited for)."""
        return self.reads.result(self.key(name))

    def _read_file(self, spec: LoraSpec) -> AdapterWeights:
        pipe_class, experts = self.reader
        return read_adapter(spec, pipe_class, experts, self.targets, self.known, self.max_rank)

    def ready(self, refs: tuple[LoraRef, ...]) -> bool:
        """Whether each of a request's adapters is read (or failed), as its file is now: its
        rows may join without waiting for a file."""
        try:
            return all(self.reads.ready(self.key(ref.name)) for ref in refs)
        except (LoraError, InvalidRequestError):
            return True  # (the join says why)

    def wait(self, refs: tuple[LoraRef, ...], timeout: float) -> None:
        """Until one of these adapters' reads is done, or `timeout` seconds passed."""
        keys = []
        for ref in refs:
            try:
                keys.append(self.key(ref.name))
            except (LoraError, InvalidRequestError):
                return
        self.reads.wait_any(keys, timeout)

    def check_registered(self, stage: str) -> None:
        """Each registered adapter read and checked now: a start-up error where one fails."""
        for spec in self.specs:
            try:
                self.read(spec.name)
            except LoraError as exc:
                raise ConfigError(f"stage {stage!r}: {exc}") from None

    def check_request(self, refs: tuple[LoraRef, ...], stage: str) -> None:
        """A request's adapters, each read and checked: its 400 where one cannot be used."""
        if len(refs) > self.per_row:
            raise InvalidRequestError(
                f"at most {self.per_row} LoRA adapters a request (--max-loras-per-request)",
                param="lora",
            )
        if len({ref.name for ref in refs}) > self.max_loras:  # (never servable: not a 503)
            raise InvalidRequestError(
                f"{len(refs)} LoRA adapters in one request but the pool holds {self.max_loras} "
                "(--max-loras)",
                param="lora",
            )
        for ref in refs:  # read on the read thread; where done already, its verdict now
            try:
                key = self.key(ref.name)
            except LoraError as exc:
                raise InvalidRequestError(
                    str(exc), stage=stage, param="lora", code="lora_unusable"
                ) from None
            self.reads.start(key)
            if self.reads.ready(key):
                self.usable(ref.name, stage)

    def usable(self, name: str, stage: str | None = None) -> AdapterWeights:
        """`read`, a file that cannot be used being the request's 400 (`lora_unusable`)."""
        try:
            return self.read(name)
        except LoraError as exc:
            raise InvalidRequestError(
                str(exc), stage=stage, param="lora", code="lora_unusable"
            ) from None

    def defaults(self, refs: tuple[LoraRef, ...]) -> tuple[int | None, float | None]:
        """The steps and guidance a request's adapters were made for (the first that says)."""
        steps = guidance = None
        for ref in refs:
            w = self.usable(ref.name)
            steps = w.steps if steps is None else steps
            guidance = w.guidance if guidance is None else guidance
        return steps, guidance

    # ---- slots -------------------------------------------------------------------------------
    def acquire(self, refs: tuple[LoraRef, ...]) -> Selection:
        """A row's adapters in their slots (written there if not resident), held until
        `release`."""
        taken: list[tuple[int, float]] = []
        try:
            for ref in refs:
                slot = self._slot(ref.name)
                self.pins[slot] += 1
                taken.append((slot, ref.scale))
        except BaseException:
            self.release(tuple(taken))
            raise
        return tuple(taken)

    def release(self, selection: Selection) -> None:
        for slot, _ in selection:
            self.pins[slot] -= 1
            if self.pins[slot] <= 0:
                del self.pins[slot]
                if slot in self.stale:  # (its file changed: no name leads to it any more)
                    self.stale.discard(slot)
                    self.free.append(slot)

    def evict(self, name: str) -> bool:
        """Adapter `name` off the device now, unless a running row holds it; whether it went."""
        slot = self.slots.get(name)
        if slot is None or self.pins[slot]:
            return False
        del self.slots[name]
        self.free.append(slot)
        return True

    def _slot(self, name: str) -> int:
        key = self._current(name)
        if name in self.slots:
            self.slots.move_to_end(name)
            return self.slots[name]
        weights = self.usable(name)  # (a file changed since the request's validation)
        if self.free:
            slot = self.free.pop()
        else:
            idle = next((n for n, s in self.slots.items() if not self.pins[s]), None)
            if idle is None:
                raise UnavailableError(
                    f"all {self.max_loras} LoRA slots (--max-loras) are held by running "
                    f"requests; {name!r} cannot be loaded now: retry",
                    code="lora_pool_full",
                )
            slot = self.slots.pop(idle)
        try:
            self._write(slot, weights)
            self.copied(slot)
        except BaseException:
            self.free.append(slot)  # (cleared by the next write into it)
            raise
        self.slots[name], self.version[slot] = slot, key
        return slot

    def _current(self, name: str) -> Key:
        """Adapter `name`'s file now; a resident slot of it read before the file changed is
        no longer its (freed now, or once the running rows that hold it leave)."""
        try:
            key = self.key(name)
        except LoraError as exc:
            raise InvalidRequestError(str(exc), param="lora", code="lora_unusable") from None
        slot = self.slots.get(name)
        if slot is not None and self.version.get(slot) != key:
            del self.slots[name]
            if self.pins[slot]:
                self.stale.add(slot)
            else:
                self.free.append(slot)
        return key

    @torch.inference_mode()
    def _write(self, slot: int, weights: AdapterWeights) -> None:
        for layer in self.layers:
            layer.clear(slot)
        for module, (a, b) in weights.layers.items():
            target = self.targets[module]
            dtype = target.layer.lora_a.dtype
            target.layer.write(slot, target.part, a.to(dtype), b.to(dtype))
        self.loads += 1

    # ---- the same pool on every rank (parallel/rank_link.py's Replicated) --------------------
    def state(self) -> LoraRows | None:
        index, scale = self.context.index, self.context.scale
        return None if index is None or scale is None else (index, scale)

    def around(self, state: LoraRows | None) -> AbstractContextManager[None]:
        return self.context.rows(state)

    def buffers(self, slot: int) -> list[torch.Tensor]:
        """Slot `slot` of every layer, A then B, in the layers' order (alike on every rank)."""
        return [t for layer in self.layers for t in (layer.lora_a[slot], layer.lora_b[slot])]

    def on_write(self, send: Callable[[int], None]) -> None:
        self.senders.append(send)

    def copied(self, slot: int) -> None:
        for send in self.senders:
            send(slot)

    # ---- a forward's rows --------------------------------------------------------------------
    def rows(self, selections: list[Selection], device: torch.device) -> LoraRows:
        """The model rows' slots (rows, max_loras_per_request) and float32 scales on the device
        (slot 0, scale 0: no adapter)."""
        index = torch.zeros(len(selections), self.per_row, dtype=torch.int64)
        scale = torch.zeros(len(selections), self.per_row, dtype=torch.float32)
        for i, selection in enumerate(selections):
            for k, (slot, value) in enumerate(selection):
                index[i, k], scale[i, k] = slot, value
        return to_device(index, device), to_device(scale, device)


def module_names(model: torch.nn.Module) -> set[str]:
    return {name for name, _ in model.named_modules()}


def build(
    config: StageConfig,
    adapter: Adapter,
    device: torch.device,
    dtype: torch.dtype,
    leader: bool = True,
) -> LoraPool | None:
    """The LoRA pool: the denoiser's attention and MLP linear layers wrapped (lora_layers.py),
    `--max-loras` slots of `--max-lora-rank` (and slot 0, none), `--max-loras-per-request` a
    row, the update's kernel chosen by the device and those sizes (lora_kernels.choose), the
    registered adapters read and checked against the base now (by rank 0: the other ranks'
    slots are copies of its)."""
    if not config.loras and config.lora_dir is None:
        return None
    experts, context = adapter.experts(), LoraContext()
    sizes = config.max_loras, config.max_lora_rank, config.max_loras_per_request
    kernel = choose(config.max_loras, config.max_loras_per_request, device)
    targets: dict[str, Target] = {}
    known: set[str] = set()
    for expert in experts:  # (two experts, Wan2.2-A14B's: one pool over both, named by expert)
        named = "" if len(experts) == 1 else expert.name + "."
        known |= {named + m for m in module_names(expert.model)}
        patterns = adapter.lora_layers()
        wrapped = wrap(expert.model, patterns, sizes[0] + 1, sizes[1], context, dtype, kernel)
        targets |= {named + m: t for m, t in wrapped.items()}
    reader = type(adapter.pipe), tuple(e.name for e in experts)
    pool = LoraPool(config.loras, config.lora_dir, targets, known, reader, sizes, context)
    if leader:
        pool.check_registered(config.name)
    logger.info(
        "stage %s: LoRA pool of %d adapters of rank %d over %d layers, %s kernel (%s registered)",
        config.name,
        sizes[0],
        sizes[1],
        len(pool.layers),
        kernel,
        ", ".join(s.name for s in config.loras) or "none",
    )
    return pool
