"""What the ranks of a sequence-parallel replica hold alike beside their models
(parallel/sequence_parallel.py with rank_link.Replicated: the LoRA pool), over a recording link in
one process: each forward's state goes in its header and is set around the other rank's forward;
a write on rank 0 goes out as a share, received in place; buffers that are not alike end the
worker. (tests/stages/test_sequence_parallel.py runs the real thing over gloo ranks.)"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from vllm_omni_like.parallel.rank_link import RankDiverged
from vllm_omni_like.parallel.sequence_parallel import SequenceFollower, SequenceLeader


class FakeLink:
    """Two ranks in one process: what rank 0 sends is what rank 1 receives, in order."""

    def __init__(self) -> None:
        self.rank, self.size, self.device = 0, 2, torch.device("cpu")
        self.members = (0, 1)  # (rank 0's group: both)
        self.objects: list[Any] = []
        self.tensors: list[torch.Tensor] = []

    def send_obj(self, obj: object, peer: int | None = None) -> None:
        self.objects.append(obj)

    def recv_obj(self, peer: int | None = None) -> Any:
        return self.objects.pop(0)

    def broadcast(self, tensor: torch.Tensor) -> None:
        if self.rank == 0:
            self.tensors.append(tensor.clone())
        else:
            tensor.copy_(self.tensors.pop(0))


class Slots:
    """A replicated state of two slots of one buffer each, and a context of the rows."""

    def __init__(self, shape: tuple[int, ...] = (2, 3)) -> None:
        self.slots = torch.zeros(2, *shape)
        self.current: Any = None
        self.seen: list[Any] = []
        self.send = lambda key: None

    def state(self) -> Any:
        return self.current

    @contextlib.contextmanager
    def around(self, state: Any) -> Iterator[None]:
        self.current = state
        try:
            yield
        finally:
            self.current = None

    def buffers(self, key: Any) -> list[torch.Tensor]:
        return [self.slots[key]]

    def on_write(self, send: Any) -> None:
        self.send = send


def test_a_forward_carries_its_state_and_a_write_its_slot_to_the_other_rank():
    link, mine, theirs = FakeLink(), Slots(), Slots()
    leader = SequenceLeader(link, mine)
    mine.slots[1] = torch.arange(6.0).reshape(2, 3)
    mine.send(1)  # (the pool calls it after its write)
    rows = torch.tensor([[1, 0]]), torch.tensor([[0.5, 0.0]])
    mine.current = rows
    x = torch.ones(1, 4)
    assert torch.equal(leader.forward("transformer", lambda t: t * 2, (x,), {}), x * 2)
    link.send_obj(("end", 7))

    link.rank = 1
    follower = SequenceFollower(link, theirs)

    def model(t: torch.Tensor) -> torch.Tensor:
        theirs.seen.append(theirs.current)  # (the state set around this rank's forward)
        return t

    follower.serve({"transformer": model}, 7)
    assert torch.equal(theirs.slots, mine.slots)  # (slot 1 copied in place)
    ((index, scale),) = theirs.seen
    assert torch.equal(index, rows[0]) and torch.equal(scale, rows[1])
    assert theirs.current is None and not link.objects and not link.tensors


def test_buffers_not_alike_on_the_other_rank_end_the_worker():
    link, mine, theirs = FakeLink(), Slots((2, 3)), Slots((2, 4))
    SequenceLeader(link, mine)
    mine.send(0)
    link.rank = 1
    follower = SequenceFollower(link, theirs)
    with pytest.raises(RankDiverged) as info:
        follower.serve({}, 1)
    assert str(info.value) == "rank 0 shares 0 in buffers this rank does not hold alike"
