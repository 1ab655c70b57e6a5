"""CFG-parallel: the two guidance branches of every denoising step on two ranks (two GPUs).

Rank 0 (the leader) runs the pipeline as one GPU would; its denoiser is wrapped so that at each
step the unconditional branch's inputs go to rank 1, rank 0 computes the conditional branch
meanwhile, then takes rank 1's output back, and the pipeline combines the two as it always
does. Rank 1 runs no pipeline: between batches it waits on its worker's pipe (no collective is
open while a replica idles, so none can time out), and during a batch it serves rank 0's calls
until rank 0 says the batch's denoising ended (`end`).

Control flow is rank 0's alone: aborts, per-request errors, bisection and requests without
guidance (run on rank 0 alone) need no agreement between the ranks, and the two cannot drift
apart. Whatever breaks the exchange itself (a rank gone, an unexpected message) ends the
worker, and the executor restarts the replica as a whole; the process group's timeout is only a
backstop behind the executor's death and stall detection.

Transport: torch.distributed point to point (NCCL on CUDA, gloo on the CPU) for tensors, and a
second, gloo (host memory) group for the small objects that steer the exchange. Per step, rank 0
sends a header (the call's structure) over the host group and the branch's tensors over the
device group, and receives a status and the branch's output, all outside any compiled region.
The header travels host to host: rank 1 reads it as soon as rank 0's host reaches the step, not
once rank 0's device has, so rank 1 launches its branch ahead of the data it waits for (on the
device), as rank 0 does; through the device group it would wait for rank 0's previous step to
end, then for its own launches (measured: 5.5 ms a step on H200s).
"""

from __future__ import annotations

import datetime
import logging
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from vllm_omni_like.stages.acceleration import BatchedCFG, denoiser_name
from vllm_omni_like.stages.base import Ranks
from vllm_omni_like.stages.isolation import (
    FatalStageError,
    is_fatal_device_error,
    is_out_of_memory,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")
WARM_UP = -1  # the batch id of the compile warm-up, which rank 0 drives at load
HEADER_BYTES = 4096  # a call's header (its arguments' structure) fits in one message


class RankDiverged(FatalStageError):
    """The ranks no longer agree on what runs, or their link broke: the worker exits and the
    replica restarts whole (never a request's error: its requests re-run elsewhere)."""


class PeerOutOfMemory(MemoryError):
    """Rank 1 ran out of memory on its branch (a request's error, like a local OOM)."""


class PeerFailed(RuntimeError):
    """Rank 1's branch raised (a request's error)."""


@dataclass(frozen=True)
class _Slot:
    """Where a tensor stood in a call's arguments: it follows the header, in order."""

    index: int


def _spec(tensor: torch.Tensor) -> tuple[tuple[int, ...], str]:
    """A tensor's shape and dtype name, as the other rank allocates it."""
    return tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")


class Link:
    """The two ranks of one replica, point to point."""

    def __init__(self, ranks: Ranks, device: torch.device, timeout_s: float) -> None:
        if ranks.size != 2 or not ranks.rendezvous:
            raise ValueError(f"CFG-parallel needs 2 ranks and a rendezvous, not {ranks}")
        self.rank = ranks.rank
        self.peer = 1 - ranks.rank
        self.device = device
        self._codes: dict[int, torch.Tensor] = {}
        if device.type == "cuda":  # (no eager NCCL init: the two talk point to point only)
            torch.cuda.set_device(device)
        else:  # both ranks compute at once on the same cores: each takes half of them, or
            # their thread pools' spinning waits slow both down (measured: 7x on 2 cores)
            torch.set_num_threads(max(1, torch.get_num_threads() // 2))
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"file://{ranks.rendezvous}",
            rank=ranks.rank,
            world_size=2,
            timeout=timeout,
        )
        # objects go host to host (gloo), whatever the tensors' backend
        self._objects = dist.new_group(backend="gloo", timeout=timeout)
        # the first exchanges set up the connections between the two: here, not in a request
        if self.rank == 0:
            self.send_obj(("hello", 0))
        if self.recv_obj() != ("hello", self.peer):
            raise RankDiverged("the other rank did not answer the handshake")
        if self.rank == 1:
            self.send_obj(("hello", 1))
        # ... and the tensors' connection (NCCL makes it at the first send, with both ranks)
        if self.rank == 0:
            self.send(self.code(0))
        elif self.recv((1,), "int64").item() != 0:
            raise RankDiverged("the other rank's first tensor was not the handshake")

    def _io(self, what: str, run: Callable[[], T]) -> T:
        try:
            return run()
        except Exception as exc:  # the peer is gone or the group broke: not a request's fault
            raise RankDiverged(f"rank {self.rank}: {what} rank {self.peer} failed: {exc}") from exc

    def send_obj(self, obj: object) -> None:
        """A small object, host to host: one fixed-size message (a longer one in a second)."""
        data = pickle.dumps(obj)
        head = np.zeros(HEADER_BYTES, np.uint8)
        head[:8] = np.frombuffer(len(data).to_bytes(8, "little"), np.uint8)
        fits = len(data) <= HEADER_BYTES - 8
        if fits:
            head[8 : 8 + len(data)] = np.frombuffer(data, np.uint8)
        self._send_host(torch.from_numpy(head))
        if not fits:
            self._send_host(torch.from_numpy(np.frombuffer(data, np.uint8).copy()))

    def recv_obj(self) -> Any:
        head = self._recv_host(HEADER_BYTES).numpy()
        size = int.from_bytes(head[:8].tobytes(), "little")
        if size <= HEADER_BYTES - 8:
            return pickle.loads(head[8 : 8 + size].tobytes())
        return pickle.loads(self._recv_host(size).numpy().tobytes())

    def _send_host(self, tensor: torch.Tensor) -> None:
        self._io("sending to", lambda: dist.send(tensor, dst=self.peer, group=self._objects))

    def _recv_host(self, size: int) -> torch.Tensor:
        tensor = torch.empty(size, dtype=torch.uint8)
        self._io("receiving from", lambda: dist.recv(tensor, src=self.peer, group=self._objects))
        return tensor

    def code(self, value: int) -> torch.Tensor:
        """A status as a one-element tensor on the device, made once per value."""
        if value not in self._codes:
            self._codes[value] = torch.full((1,), value, dtype=torch.int64, device=self.device)
        return self._codes[value]

    def send(self, tensor: torch.Tensor) -> None:
        self._io("sending to", lambda: dist.send(tensor.contiguous(), dst=self.peer))

    def recv(self, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
        self._io("receiving from", lambda: dist.recv(tensor, src=self.peer))
        return tensor

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass(frozen=True)
class _Kept:
    """A tensor the previous call of this pipeline call passed too (the very object: the call's
    prompt embeddings), which rank 1 still holds: its place in that call's tensors."""

    index: int


def _pack(value: Any, new: list[torch.Tensor], every: list[torch.Tensor], kept: dict) -> Any:
    """`value` with each tensor replaced by its slot: a new one (sent after the header, in
    order) or one the previous call passed (`kept`: id -> its place there); `every` gets all
    of them in order, the places of the next call's kept ones."""
    if isinstance(value, torch.Tensor):
        every.append(value)
        if id(value) in kept:
            return _Kept(kept[id(value)])
        new.append(value)
        return _Slot(len(new) - 1)
    if isinstance(value, dict):
        return {k: _pack(v, new, every, kept) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_pack(v, new, every, kept) for v in value)
    return value


def _unpack(value: Any, new: list[torch.Tensor], every: list[torch.Tensor], held: list) -> Any:
    if isinstance(value, _Slot | _Kept):
        tensor = new[value.index] if isinstance(value, _Slot) else held[value.index]
        every.append(tensor)
        return tensor
    if isinstance(value, dict):
        return {k: _unpack(v, new, every, held) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_unpack(v, new, every, held) for v in value)
    return value


OK, FAILED, OUT_OF_MEMORY = 0, 1, 2  # rank 1's status of one branch call


class Leader:
    """Rank 0's side: a branch runs on rank 1 while rank 0 computes its own.

    The first call of a pipeline call (after `arm`) waits for rank 1's status, which carries
    the output's shape; every later call only posts its receives, so no step waits on the host
    for rank 1 (the device waits, where the output is used): the ranks' host work per step
    (the scheduler, callbacks, launches) stays hidden behind the device's, as on one GPU. Their
    statuses are read once, in `settle`, after the pipeline call."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.expect: tuple[tuple[int, ...], str] | None = None
        self.statuses: list[torch.Tensor] = []
        self.passed: list[torch.Tensor] = []  # the previous call's tensors, which rank 1 holds

    def arm(self) -> None:
        self.expect, self.statuses, self.passed = None, [], []

    def alongside(self, local: Callable[[], T], args: tuple, kwargs: dict) -> tuple[T, Any]:
        """`local()` here while rank 1 runs the model on (args, kwargs); both outputs."""
        tensors: list[torch.Tensor] = []
        every: list[torch.Tensor] = []
        first = self.expect is None
        kept = {} if first else {id(t): i for i, t in enumerate(self.passed)}
        meta = _pack((args, kwargs), tensors, every, kept)
        self.passed = every
        specs = [_spec(t) for t in tensors]
        self.link.send_obj(("call", meta, specs, first))
        for t in tensors:
            self.link.send(t)
        try:
            mine = local()
        except BaseException as exc:
            if not is_fatal_device_error(exc):
                self._collect(first)  # rank 1's answer still comes: take it, then fail
            raise
        return mine, self._collect(first)

    def _collect(self, first: bool) -> torch.Tensor:
        if not first:
            assert self.expect is not None
            status = self.link.recv((1,), "int64")
            self.statuses.append(status)
            return self.link.recv(*self.expect)
        match self.link.recv_obj():
            case ("ok", shape, dtype):
                self.expect = (tuple(shape), dtype)
                return self.link.recv(shape, dtype)
            case ("error", code, text):
                raise (PeerOutOfMemory if code == OUT_OF_MEMORY else PeerFailed)(
                    f"CFG-parallel rank 1: {text}"
                )
            case other:
                raise RankDiverged(f"rank 1 answered {other!r:.200}")

    def settle(self) -> None:
        """Raise if any of rank 1's branches since `arm` failed (its log says how)."""
        statuses, self.statuses, self.passed = self.statuses, [], []
        codes = set(torch.cat(statuses).tolist()) if statuses else set()
        if OUT_OF_MEMORY in codes:
            raise PeerOutOfMemory("CFG-parallel rank 1 ran out of memory on its branch")
        if FAILED in codes:
            raise PeerFailed("CFG-parallel rank 1's branch failed (its log in the server's)")

    def end(self, batch_id: int) -> None:
        self.link.send_obj(("end", batch_id))


def serve(
    link: Link, model: Any, batch_id: int, mark: Callable[[str], None] = lambda label: None
) -> None:
    """Rank 1: run rank 0's branch calls on `model` until it ends batch `batch_id`. A first
    call answers with a status object (the output's shape); later ones with a status tensor
    and an output of that shape (zeros after a failure, which rank 0's `settle` reports).
    `mark` is called as each branch starts and ends (a timeline's points, stages/trace.py)."""
    expect: tuple[tuple[int, ...], str] | None = None
    held: list[torch.Tensor] = []  # the previous call's tensors (its kept ones come again)
    while True:
        match link.recv_obj():
            case ("end", ended) if ended == batch_id:
                return
            case ("call", meta, specs, first) if first or expect is not None:
                tensors = [link.recv(shape, dtype) for shape, dtype in specs]
                every: list[torch.Tensor] = []
                args, kwargs = _unpack(meta, tensors, every, [] if first else held)
                held = every
            case other:
                raise RankDiverged(f"serving batch {batch_id}, rank 0 sent {other!r:.200}")
        code, out = OK, None
        try:
            mark("branch")
            with torch.inference_mode():
                out = model(*args, **kwargs)[0]
            mark("done")
        except Exception as exc:
            if is_fatal_device_error(exc):
                raise
            code = OUT_OF_MEMORY if is_out_of_memory(exc) else FAILED
            if code == OUT_OF_MEMORY and torch.cuda.is_available():
                torch.cuda.empty_cache()
            logger.warning("CFG-parallel rank 1: the branch of batch %d raised %r", batch_id, exc)
            text = f"{type(exc).__name__}: {exc}"
        if first:
            if out is None:
                link.send_obj(("error", code, text))
                continue
            expect = _spec(out)
            link.send_obj(("ok", *expect))
            link.send(out)
            continue
        assert expect is not None
        if out is not None and _spec(out) != expect:
            code, out = FAILED, None
            logger.warning("CFG-parallel rank 1: an output's shape changed within a call")
        link.send(link.code(code))
        if out is None:
            out = torch.zeros(expect[0], dtype=getattr(torch, expect[1]), device=link.device)
        link.send(out)
        del out, args, kwargs, tensors, every


class SplitCFG(torch.nn.Module):
    """A UNet pipeline's doubled guidance batch (negative half, then positive) over two ranks:
    rank 1 runs the first half, rank 0 the second. Armed with the doubled batch's rows; any
    other call (no guidance, another batch size) runs here whole."""

    needs_embeddings = False

    def __init__(self, model: torch.nn.Module, leader: Leader) -> None:
        super().__init__()
        self.model = model
        self.leader = leader
        self.rows = 0

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.model, name)

    def arm(self, kwargs: dict[str, Any]) -> None:
        self.rows = 2 * len(kwargs["generator"])
        self.leader.arm()

    def settle(self) -> None:
        self.leader.settle()

    def disarm(self) -> None:
        self.rows = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        sample = args[0] if args else kwargs.get("sample")
        rows = self.rows
        if not rows or sample is None or sample.shape[0] != rows or kwargs.get("return_dict", True):
            return self.model(*args, **kwargs)
        first, second = slice(0, rows // 2), slice(rows // 2, rows)
        mine, theirs = self.leader.alongside(
            lambda: self.model(*_half(args, rows, second), **_half(kwargs, rows, second)),
            _half(args, rows, first),
            _half(kwargs, rows, first),
        )
        return (torch.cat([theirs, mine[0]]), *mine[1:])


def _half(value: Any, rows: int, part: slice) -> Any:
    """Every tensor of `rows` rows in `value`, cut to `part`; the rest as it is."""
    if isinstance(value, torch.Tensor):
        return value[part] if value.dim() > 0 and value.shape[0] == rows else value
    if isinstance(value, dict):
        return {k: _half(v, rows, part) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_half(v, rows, part) for v in value)
    return value


class PairCFG(BatchedCFG):
    """A pipeline that calls its denoiser once per branch (Wan): the conditional call runs here
    while rank 1 runs the unconditional one; the unconditional call then gets rank 1's output."""

    def __init__(self, model: torch.nn.Module, leader: Leader) -> None:
        super().__init__(model)
        self.leader = leader

    def arm(self, kwargs: dict[str, Any]) -> None:
        super().arm(kwargs)
        self.leader.arm()

    def settle(self) -> None:
        self.leader.settle()

    def _branches(self, kwargs: dict[str, Any], negative: torch.Tensor) -> tuple[tuple, tuple]:
        mine, theirs = self.leader.alongside(
            lambda: self.model(**kwargs), (), dict(kwargs, encoder_hidden_states=negative)
        )
        return tuple(mine), (theirs, *tuple(mine)[1:])


def keep_only_the_denoiser(pipe: Any) -> list[str]:
    """Rank 1: drop every model of the pipeline but its denoiser (text encoders, VAE: a Wan
    text encoder alone is 11 GB in 16 bits); the names dropped."""
    keep = denoiser_name(pipe)
    dropped = [
        name
        for name, part in pipe.components.items()
        if name != keep and isinstance(part, torch.nn.Module)
    ]
    for name in dropped:
        setattr(pipe, name, None)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return dropped


def split_branches(pipe: Any, leader: Leader) -> SplitCFG | PairCFG:
    """Rank 0: wrap the pipeline's denoiser so its guidance branches run on both ranks."""
    name = denoiser_name(pipe)
    if name == "unet":
        wrapper: SplitCFG | PairCFG = SplitCFG(pipe.unet, leader)
    elif type(pipe).__name__ == "WanPipeline" and getattr(pipe, "transformer_2", None) is None:
        wrapper = PairCFG(pipe.transformer, leader)
    else:
        raise ValueError(f"CFG-parallel runs UNet and Wan pipelines, not {type(pipe).__name__}")
    setattr(pipe, name, wrapper)
    return wrapper
