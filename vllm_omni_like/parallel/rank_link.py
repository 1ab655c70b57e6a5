"""The ranks of a replica rank 0 leads, point to point between rank 0 (or a group's leader) and
each other rank, and collectives over a group: CFG-parallel's two (parallel/cfg_parallel.py
runs the exchange over it), sequence parallelism's N (parallel/sequence_parallel.py), and both
at once: two groups of N, the second led by rank N, rank 0's CFG-parallel partner.

torch.distributed (NCCL on CUDA, gloo on the CPU) carries the tensors, and a second, gloo (host
memory) group the small objects that steer the exchange. A call's arguments travel as a header
(their structure, each tensor replaced by its slot) and the tensors after it; a tensor the
previous call of the same pipeline call passed too (the very object: the prompt embeddings) is
not sent again but named by its place in that call (`_Kept`), as the other rank still holds it.

What every rank holds alike beside its models (a LoRA pool: `Replicated`) is kept alike by rank 0
alone: what it sets around a forward travels with that forward's arguments, and each write into
its buffers is copied into the others' as it is made, in the order of the forwards.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from vllm_omni_like.errors import FatalStageError
from vllm_omni_like.parallel.ranks import Ranks

T = TypeVar("T")
HEADER_BYTES = 4096  # a call's header (its arguments' structure) fits in one message


class RankDiverged(FatalStageError):
    """The ranks no longer agree on what runs, or their link broke: the worker exits and the
    replica restarts whole (never a request's error: its requests re-run elsewhere)."""


@dataclass(frozen=True)
class _Slot:
    """Where a tensor stood in a call's arguments: it follows the header, in order."""

    index: int


Spec = tuple[tuple[int, ...], str]


class Replicated(Protocol):
    """State beside the models that every rank of a replica holds alike (a LoRA pool), kept
    alike by rank 0: each forward carries what rank 0 set around it, each write is copied."""

    def state(self) -> Any:
        """What the forward about to run reads beside its arguments (tensors, or None)."""

    def around(self, state: Any) -> AbstractContextManager[Any]:
        """Another rank: `state`, as rank 0 sent it, set around its forward."""

    def buffers(self, key: Any) -> list[torch.Tensor]:
        """Its buffers of `key` (a slot), contiguous, alike in order and shape on every rank."""

    def on_write(self, send: Callable[[Any], None]) -> None:
        """Rank 0 (or a group's leader): `send(key)` is called after each write into `key`'s
        buffers, each sender registered in its order."""

    def copied(self, key: Any) -> None:
        """`key`'s buffers were just copied here from rank 0: its senders pass them on (the
        unconditional branch's group's leader, into its group's)."""


def tensor_spec(tensor: torch.Tensor) -> Spec:
    """A tensor's shape and dtype name, as the other rank allocates it."""
    return tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")


def shape_key(args: tuple, kwargs: dict, every: list[torch.Tensor]) -> tuple:
    """What fixes a call's output shape: its arguments' names and its tensors' specs."""
    return len(args), tuple(sorted(kwargs)), tuple(tensor_spec(t) for t in every)


class Link:
    """The ranks of one replica: rank 0 and each other rank point to point, and collectives
    over a sequence-parallel group (`collectives`: their connections made at the start too).
    `peer`, the default one: rank 0's CFG-parallel partner (rank 1, or the second group's
    leader), that partner's rank 0, any other rank its group's leader (`leader`; rank 0 and
    the second group's leader name their group's `members`)."""

    def __init__(
        self, ranks: Ranks, device: torch.device, timeout_s: float, collectives: bool = False
    ) -> None:
        if ranks.size < 2 or not ranks.rendezvous:
            raise ValueError(f"a link needs 2 ranks or more and a rendezvous, not {ranks}")
        self.rank = ranks.rank
        self.size = ranks.size
        n = self.sequence = ranks.sequence  # (1: no sequence parallelism)
        self.leader = ranks.rank - ranks.rank % n  # this rank's group's leader
        self.members = tuple(range(self.leader, self.leader + n))
        if ranks.rank == 0:
            self.peer = n if ranks.size > n else 1
        else:
            self.peer = 0 if ranks.rank == self.leader else self.leader
        self.device = device
        self._codes: dict[int, torch.Tensor] = {}
        if device.type == "cuda":  # (NCCL's connections come with the first exchanges below)
            torch.cuda.set_device(device)
        else:  # the ranks compute at once on the same cores: each takes its share of them, or
            # their thread pools' spinning waits slow all down (measured: 7x for 2 on 2 cores)
            torch.set_num_threads(max(1, torch.get_num_threads() // ranks.size))
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"file://{ranks.rendezvous}",
            rank=ranks.rank,
            world_size=ranks.size,
            timeout=timeout,
        )
        # objects go host to host (gloo), whatever the tensors' backend
        self._objects = dist.new_group(backend="gloo", timeout=timeout)
        self._group = dist.group.WORLD  # (one group of sequence parallelism: every rank)
        if n < ranks.size:  # every rank makes every group, in one order
            made = [
                dist.new_group(list(range(s, s + n)), timeout=timeout)
                for s in range(0, ranks.size, n)
            ]
            self._group = made[ranks.rank // n]
        self._handshake(collectives)

    def _handshake(self, collectives: bool) -> None:
        """The first exchanges set up the connections between the ranks: here, not in a
        request: objects, then tensors (NCCL makes a pair's at its first send), then the
        collectives' (at the first one). The pairs that exchange - rank 0 and each other rank,
        a later group's leader and its members - in one order on every rank."""
        n = self.sequence
        pairs = [(0, r) for r in range(1, self.size)]
        pairs += [(s, r) for s in range(n, self.size, n) for r in range(s + 1, s + n)]
        for first, second in pairs:
            if self.rank in (first, second):
                self._greet(second if self.rank == first else first, self.rank == first)
        if collectives:
            self.broadcast(self.code(0).clone())

    def _greet(self, peer: int, first: bool) -> None:
        if first:
            self.send_obj(("hello", self.rank), peer)
        if self.recv_obj(peer) != ("hello", peer):
            raise RankDiverged(f"rank {peer} did not answer the handshake")
        if not first:
            self.send_obj(("hello", self.rank), peer)
        if first:
            self.send(self.code(0), peer)
        elif self.recv((1,), "int64", peer).item() != 0:
            raise RankDiverged(f"rank {peer}'s first tensor was not the handshake")

    @property
    def group(self) -> Any:
        """This rank's sequence-parallel (device) process group, for collectives: every rank,
        or (CFG-parallel x sequence parallel) its branch's group."""
        return self._group

    def _io(self, what: str, peer: int | str, run: Callable[[], T]) -> T:
        try:
            return run()
        except Exception as exc:  # a peer is gone or the group broke: not a request's fault
            raise RankDiverged(f"rank {self.rank}: {what} {peer} failed: {exc}") from exc

    def broadcast(self, tensor: torch.Tensor) -> None:
        """`tensor` from the group's leader to its every rank (the others' `tensor` receive it)."""
        run = lambda: dist.broadcast(tensor, src=self.leader, group=self._group)  # noqa: E731
        self._io("broadcast with", "every rank", run)

    def send_obj(self, obj: object, peer: int | None = None) -> None:
        """A small object, host to host: one fixed-size message (a longer one in a second)."""
        data = pickle.dumps(obj)
        head = np.zeros(HEADER_BYTES, np.uint8)
        head[:8] = np.frombuffer(len(data).to_bytes(8, "little"), np.uint8)
        fits = len(data) <= HEADER_BYTES - 8
        if fits:
            head[8 : 8 + len(data)] = np.frombuffer(data, np.uint8)
        peer = self.peer if peer is None else peer
        self._send_host(torch.from_numpy(head), peer)
        if not fits:
            self._send_host(torch.from_numpy(np.frombuffer(data, np.uint8).copy()), peer)

    def recv_obj(self, peer: int | None = None) -> Any:
        peer = self.peer if peer is None else peer
        head = self._recv_host(HEADER_BYTES, peer).numpy()
        size = int.from_bytes(head[:8].tobytes(), "little")
        if size <= HEADER_BYTES - 8:
            return pickle.loads(head[8 : 8 + size].tobytes())
        return pickle.loads(self._recv_host(size, peer).numpy().tobytes())

    def _send_host(self, tensor: torch.Tensor, peer: int) -> None:
        group = self._objects
        self._io("sending to rank", peer, lambda: dist.send(tensor, dst=peer, group=group))

    def _recv_host(self, size: int, peer: int) -> torch.Tensor:
        tensor = torch.empty(size, dtype=torch.uint8)
        group = self._objects
        self._io("receiving from rank", peer, lambda: dist.recv(tensor, src=peer, group=group))
        return tensor

    def code(self, value: int) -> torch.Tensor:
        """A status as a one-element tensor on the device, made once per value."""
        if value not in self._codes:
            self._codes[value] = torch.full((1,), value, dtype=torch.int64, device=self.device)
        return self._codes[value]

    def send(self, tensor: torch.Tensor, peer: int | None = None) -> None:
        dst = self.peer if peer is None else peer
        self._io("sending to rank", dst, lambda: dist.send(tensor.contiguous(), dst=dst))

    def recv(self, shape: tuple[int, ...], dtype: str, peer: int | None = None) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
        return self.recv_into(tensor, peer)

    def recv_into(self, tensor: torch.Tensor, peer: int | None = None) -> torch.Tensor:
        """Receive into `tensor` (contiguous) itself."""
        src = self.peer if peer is None else peer
        self._io("receiving from rank", src, lambda: dist.recv(tensor, src=src))
        return tensor

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class BatchEnds:
    """A serving rank's (CFG-parallel's rank 1, a sequence-parallel follower) account of rank
    0's batch ends. Rank 0 ends each batch once, in the order its batches end (a running set's
    short group may end before a long one that came first): an end of another batch than the
    one served is kept, and that batch, when its turn comes, is over at once."""

    def __init__(self) -> None:
        self.early: set[int] = set()  # batches rank 0 ended before this rank served them

    def messages(self, link: Link, batch_id: int) -> Iterator[Any]:
        """Rank 0's messages (its calls, its shares) while this rank serves batch `batch_id`,
        until rank 0 ends it; none where it ended before."""
        if batch_id in self.early:
            self.early.discard(batch_id)
            return
        while True:
            match message := link.recv_obj():
                case ("end", ended) if ended == batch_id:
                    return
                case ("end", ended):
                    self.early.add(ended)
                case _:
                    yield message


@dataclass(frozen=True)
class _Kept:
    """A tensor the previous call of this pipeline call passed too (the very object: the call's
    prompt embeddings), which rank 1 still holds: its place in that call's tensors."""

    index: int


def map_leaves(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """`value` with `leaf` applied to everything but its dicts, lists and tuples, in order."""
    if isinstance(value, dict):
        return {k: map_leaves(v, leaf) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(map_leaves(v, leaf) for v in value)
    return leaf(value)


def pack_args(value: Any, new: list[torch.Tensor], every: list[torch.Tensor], kept: dict) -> Any:
    """`value` with each tensor replaced by its slot: a new one (sent after the header, in
    order) or one the previous call passed (`kept`: id -> its place there); `every` gets all
    of them in order, the places of the next call's kept ones."""

    def slot(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        every.append(leaf)
        if id(leaf) in kept:
            return _Kept(kept[id(leaf)])
        new.append(leaf)
        return _Slot(len(new) - 1)

    return map_leaves(value, slot)


def unpack_args(value: Any, new: list[torch.Tensor], every: list[torch.Tensor], held: list) -> Any:
    """`pack_args` undone: the new tensors as received, the kept ones from `held`."""

    def tensor(leaf: Any) -> Any:
        if not isinstance(leaf, _Slot | _Kept):
            return leaf
        found = new[leaf.index] if isinstance(leaf, _Slot) else held[leaf.index]
        every.append(found)
        return found

    return map_leaves(value, tensor)
