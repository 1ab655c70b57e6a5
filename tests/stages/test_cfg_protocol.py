"""The CFG-parallel exchange between the ranks (parallel/cfg_parallel.py: Leader and Follower), over
an in-memory link in two threads: what travels per call, and what the ranks remember."""

from __future__ import annotations

import queue
import threading
import time
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from vllm_omni_like.parallel import cfg_parallel
from vllm_omni_like.parallel.cfg_parallel import (
    Follower,
    Leader,
    LoopBranches,
    PeerFailed,
    ServedBranches,
)
from vllm_omni_like.parallel.rank_link import RankDiverged


class QueueLink:
    """One rank's end of a link whose messages go through queues; it records what it sends."""

    def __init__(self, inbox: queue.Queue, outbox: queue.Queue) -> None:
        self.inbox, self.outbox = inbox, outbox
        self.device = torch.device("cpu")
        self.objects: list[Any] = []
        self.tensors: list[tuple[int, ...]] = []

    def send_obj(self, obj: object) -> None:
        self.objects.append(obj)
        self.outbox.put(("obj", obj))

    def recv_obj(self) -> Any:
        kind, value = self.inbox.get(timeout=10)
        assert kind == "obj", value
        return value

    def send(self, tensor: torch.Tensor) -> None:
        self.tensors.append(tuple(tensor.shape))
        self.outbox.put(("tensor", tensor.clone()))

    def recv(self, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        kind, tensor = self.inbox.get(timeout=10)
        assert kind == "tensor" and tuple(tensor.shape) == tuple(shape)
        assert tensor.dtype == getattr(torch, dtype)
        return tensor

    def recv_into(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.copy_(self.recv(tuple(tensor.shape), str(tensor.dtype)[6:]))

    def code(self, value: int) -> torch.Tensor:
        return torch.full((1,), value, dtype=torch.int64)


def model(hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor):
    if hidden_states.isnan().any():  # the tests' way to make a branch fail
        raise RuntimeError("the branch broke")
    return (2 * hidden_states + encoder_hidden_states.mean(),)


@pytest.fixture
def ranks():
    """A leader, and a follower serving batches 1, 2, ... in a thread until the test ends."""
    a, b = queue.Queue(), queue.Queue()
    lead, follow = QueueLink(a, b), QueueLink(b, a)
    follower = Follower(follow)
    batches = queue.Queue()
    errors: list[BaseException] = []

    def serve() -> None:
        while (batch_id := batches.get()) is not None:
            try:
                follower.serve(model, batch_id)
            except BaseException as exc:  # the test's failure, not a hang
                errors.append(exc)
                return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield Leader(lead), lead, follow, batches
    batches.put(None)
    thread.join(10)
    assert not thread.is_alive() and not errors, errors


def pipeline_call(leader: Leader, batch_id: int, side: int, steps: int, fail_at: int = -1):
    """A pipeline call's steps as PairCFG makes them: the negative embeddings (the very object
    each step) and new latents; rank 1's outputs, checked against the model's."""
    negative = torch.randn(1, 8, 4)
    leader.arm()
    try:
        for step in range(steps):
            latents = torch.randn(1, 4, side, side)
            local = (2 * latents + negative.mean(),)
            if step == fail_at:
                latents = torch.full_like(latents, float("nan"))
            kwargs = {"hidden_states": latents, "encoder_hidden_states": negative}
            mine, theirs = leader.alongside(lambda out=local: out, (), kwargs)
            if step != fail_at:
                assert torch.equal(theirs, mine[0])
        leader.settle()
    finally:
        leader.end(batch_id)


def test_the_output_shape_is_asked_once_and_the_embeddings_go_once_a_call(ranks):
    leader, lead, follow, batches = ranks
    batches.put(1)
    pipeline_call(leader, 1, side=6, steps=4)
    assert follow.objects == [("ok", (1, 4, 6, 6), "float32")]  # the one handshake
    # each step sends its latents; the embeddings with the first step only
    assert lead.tensors == [(1, 4, 6, 6), (1, 8, 4)] + [(1, 4, 6, 6)] * 3
    # a later pipeline call of that shape: no handshake; its own embeddings, once
    lead.tensors.clear()
    batches.put(2)
    pipeline_call(leader, 2, side=6, steps=3)
    assert len(follow.objects) == 1
    assert lead.tensors == [(1, 4, 6, 6), (1, 8, 4), (1, 4, 6, 6), (1, 4, 6, 6)]
    # another shape: asked once more
    batches.put(3)
    pipeline_call(leader, 3, side=8, steps=2)
    assert follow.objects[1:] == [("ok", (1, 4, 8, 8), "float32")]


def test_a_failed_first_call_teaches_nothing_and_a_later_failure_surfaces_at_settle(ranks):
    leader, _, follow, batches = ranks
    batches.put(1)
    with pytest.raises(PeerFailed, match="rank 1: RuntimeError: the branch broke"):
        pipeline_call(leader, 1, side=5, steps=3, fail_at=0)
    assert follow.objects == [("error", cfg_parallel.FAILED, "RuntimeError: the branch broke")]
    batches.put(2)  # the shape is still unknown: asked again, then remembered
    with pytest.raises(PeerFailed, match="rank 1's branch failed"):  # zeros came; settle says
        pipeline_call(leader, 2, side=5, steps=3, fail_at=2)
    assert follow.objects[1:] == [("ok", (1, 4, 5, 5), "float32")]
    batches.put(3)
    pipeline_call(leader, 3, side=5, steps=2)  # and the replica serves on
    assert len(follow.objects) == 2


class Pool:
    """A replicated state of two slots of one buffer each (a LoRA pool's stand-in): `rows`, what
    a forward runs with; `passed`, the slots copied in and passed on (to its group's)."""

    def __init__(self, width: int = 3) -> None:
        self.slots = {1: torch.zeros(width), 2: torch.zeros(width)}
        self.senders: list = []
        self.rows: Any = None
        self.passed: list[int] = []

    def write(self, slot: int, value: float) -> None:
        self.slots[slot].fill_(value)
        for send in self.senders:
            send(slot)

    def state(self) -> Any:
        return self.rows

    @contextmanager
    def around(self, state: Any):
        self.rows = state
        try:
            yield
        finally:
            self.rows = None

    def buffers(self, key: int) -> list[torch.Tensor]:
        return [self.slots[key]]

    def on_write(self, send) -> None:
        self.senders.append(send)

    def copied(self, key: int) -> None:
        self.passed.append(key)


def _replicas(width: int):
    """Rank 0's pool and leader; rank 1's pool, follower serving our own loop's forwards (each
    the slot its rows name, times its latents) in a thread, and the error it raised."""
    a, b = queue.Queue(), queue.Queue()
    mine, theirs = Pool(), Pool(width)
    leader, follower = Leader(QueueLink(a, b), replicated=mine), Follower(QueueLink(b, a), theirs)

    def loop(inputs: dict, at: Any) -> torch.Tensor:
        return inputs["latents"] * theirs.slots[int(inputs["slot"].item())]

    errors: list[BaseException] = []

    def serve() -> None:
        try:
            follower.serve(ServedBranches(None, loop), 1)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return mine, LoopBranches(leader), theirs, thread, errors


def test_a_slot_written_reaches_rank_1_before_the_forward_that_reads_it():
    mine, branches, theirs, thread, errors = _replicas(3)
    ones = torch.ones(3)
    try:
        mine.write(1, 2.0)
        _, out = branches.alongside(lambda: None, {"latents": ones, "slot": torch.tensor(1)}, None)
        assert out.tolist() == [2.0] * 3
        mine.write(2, 5.0)  # (a row joining mid-set: its slot, then the forward reading it)
        _, out = branches.alongside(lambda: None, {"latents": ones, "slot": torch.tensor(2)}, None)
        assert out.tolist() == [5.0] * 3 and theirs.passed == [1, 2]
    finally:
        branches.leader.end(1)
        thread.join(10)
    assert not thread.is_alive() and not errors, errors


def test_a_slot_rank_1_holds_unlike_rank_0_ends_the_worker():
    """A pool of another shape on rank 1 (never meant to happen): the share is refused as the
    ranks diverged (the worker exits; the replica restarts whole)."""
    mine, _, theirs, thread, errors = _replicas(4)
    start = time.monotonic()
    mine.write(1, 2.0)
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - start < 5
    assert [str(e) for e in errors] == ["rank 0 shares 1 in buffers this rank does not hold alike"]
    assert isinstance(errors[0], RankDiverged) and theirs.passed == []
    assert theirs.slots[1].tolist() == [0.0] * 4  # (nothing copied)
