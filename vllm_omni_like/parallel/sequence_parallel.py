"""Sequence parallelism led by one rank: each denoiser forward of a replica runs on its N ranks
at once, each rank holding the whole model and 1/N of the latent tokens (parallel/ulysses.py:
its share, and attention over the whole sequence).

Rank 0 (the leader) runs the stage as one GPU would - the loop, the running set, aborts,
errors, bisection: every decision - and its denoisers are wrapped (`SequenceParallelDenoiser`)
so that each forward is handed to the other ranks as it starts: a header naming the denoiser
and its arguments' structure (host to host), then the new tensors, broadcast from rank 0; then
every rank runs the same forward on the same inputs, its adapter's hooks splitting the tokens
(models/<family>/sequence_parallel.py), the attention exchanging them, the output gathered. The
other ranks (followers) run no loop: between batches they wait on their worker's pipe (no
collective is open while a replica idles), and during a batch they serve rank 0's forwards
until rank 0 ends it. No control decision needs a vote: the followers only ever do what the
header says. With CFG-parallel beside it, rank N leads a second group the same way, through
the unconditional forwards rank 0 hands it (`Link.members`: a leader's group).

A forward's collectives bind the ranks together: a rank that fails inside one (out of memory
included) leaves the others waiting in it, so any failure once the header went out ends the
worker (`RankDiverged`), and the executor restarts the replica as a whole; the process group's
timeout is only a backstop behind the executor's death and stall detection. Tensors passed by
the previous forward as the very same object (the prompt embeddings) are not sent again
(parallel/rank_link.py's packing, as CFG-parallel's).

What every rank holds alike beside its models (`Replicated`: the LoRA pool) stays alike: what rank
0 sets around a forward (each model row's adapter slots and scales) goes in that forward's
header and tensors, and each slot rank 0 writes (a row's adapter joining) is broadcast into the
others' copies as it is written ("share"), in order with the forwards; with CFG-parallel beside
it, the second group's leader broadcasts each slot rank 0 sent it into its group's.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from vllm_omni_like.parallel.branches import DenoiserWrapper
from vllm_omni_like.parallel.rank_link import (
    BatchEnds,
    Link,
    RankDiverged,
    Replicated,
    pack_args,
    tensor_spec,
    unpack_args,
)

logger = logging.getLogger(__name__)


class SequenceLeader:
    """Rank 0's side: hands each forward to the other ranks and runs its own share."""

    def __init__(self, link: Link, replicated: Replicated | None = None) -> None:
        self.link = link
        self.passed: list[torch.Tensor] = []  # the previous forward's tensors (the others hold)
        self.replicated = replicated
        if replicated is not None:
            replicated.on_write(self.share)

    def forward(self, name: str, model: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """`model(*args, **kwargs)` on every rank (the others run their denoiser `name`)."""
        link = self.link
        tensors: list[torch.Tensor] = []
        every: list[torch.Tensor] = []
        kept = {id(t): i for i, t in enumerate(self.passed)}
        state = None if self.replicated is None else self.replicated.state()
        meta = pack_args((args, kwargs, state), tensors, every, kept)
        self.passed = every
        header = ("call", name, meta, [tensor_spec(t) for t in tensors])
        for peer in link.members[1:]:
            link.send_obj(header, peer)
        try:
            for t in tensors:
                link.broadcast(t.contiguous())
            return model(*args, **kwargs)
        except RankDiverged:
            raise
        except Exception as exc:  # the others wait in this forward's collectives: no way back
            logger.exception("rank 0: a sequence-parallel forward of %s failed", name)
            raise RankDiverged(
                f"rank 0: a sequence-parallel forward failed: {type(exc).__name__}: {exc}"
            ) from exc

    def share(self, key: Any) -> None:
        """The replicated state's buffers of `key`, just written here, into every rank's."""
        assert self.replicated is not None
        buffers = self.replicated.buffers(key)
        header = ("share", key, [tensor_spec(t) for t in buffers])
        for peer in self.link.members[1:]:  # (its group's: the other group's leader copies)
            self.link.send_obj(header, peer)
        for t in buffers:
            self.link.broadcast(t)

    def end(self, batch_id: int) -> None:
        """Batch `batch_id` needs no more forwards: the other ranks stop serving it."""
        for peer in self.link.members[1:]:
            self.link.send_obj(("end", batch_id), peer)


class SequenceFollower:
    """A rank > 0: serves rank 0's forwards, batch after batch (ends in another order than the
    batches': rank_link.BatchEnds)."""

    def __init__(self, link: Link, replicated: Replicated | None = None) -> None:
        self.link = link
        self.ends = BatchEnds()
        self.held: list[torch.Tensor] = []  # the previous forward's tensors
        self.replicated = replicated

    def serve(self, models: dict[str, Callable[..., Any]], batch_id: int) -> None:
        """Run rank 0's forwards on `models` (by name) until it ends batch `batch_id`. Any
        failure raises (the worker exits: the other ranks wait in the forward's collectives)."""
        for message in self.ends.messages(self.link, batch_id):
            match message:
                case ("call", name, meta, specs) if name in models:
                    tensors = [self._received(shape, dtype) for shape, dtype in specs]
                    every: list[torch.Tensor] = []
                    args, kwargs, state = unpack_args(meta, tensors, every, self.held)
                    self.held = every
                    self._run(models[name], name, args, kwargs, state)
                    del args, kwargs, tensors, state
                case ("share", key, specs):
                    self._share(key, specs)
                case other:
                    raise RankDiverged(f"serving batch {batch_id}, rank 0 sent {other!r:.200}")

    def _run(
        self, model: Callable[..., Any], name: str, args: tuple, kwargs: dict, state: Any
    ) -> None:
        replicated = self.replicated
        around = nullcontext() if replicated is None else replicated.around(state)
        try:
            with torch.inference_mode(), around:
                model(*args, **kwargs)
        except Exception:  # (the worker exits on it: its traceback goes to the log first)
            logger.exception(
                "rank %d: a sequence-parallel forward of %s failed", self.link.rank, name
            )
            raise

    def _share(self, key: Any, specs: list) -> None:
        """Rank 0's buffers of `key` into this rank's, as it wrote them."""
        buffers = [] if self.replicated is None else self.replicated.buffers(key)
        if [tensor_spec(t) for t in buffers] != specs:
            raise RankDiverged(f"rank 0 shares {key!r} in buffers this rank does not hold alike")
        with torch.inference_mode():
            for t in buffers:
                self.link.broadcast(t)

    def _received(self, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=self.link.device)
        self.link.broadcast(tensor)
        return tensor


class SequenceParallelCall:
    """Rank 0's `call` (a VAE's patch-parallel decode) run by every rank at once, as `name`."""

    def __init__(self, call: Callable[..., Any], name: str, leader: SequenceLeader) -> None:
        self.call = call
        self.name = name
        self.leader = leader

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.leader.forward(self.name, self.call, args, kwargs)


class SequenceParallelDenoiser(DenoiserWrapper):
    """Rank 0's denoiser `name` whose every forward runs on all the replica's ranks."""

    def __init__(self, model: torch.nn.Module, name: str, leader: SequenceLeader) -> None:
        super().__init__(model)
        self.name = name
        self.leader = leader

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.leader.forward(self.name, self.model, args, kwargs)


def heads_note(heads: int, size: int) -> str | None:
    """What an attention of `heads` heads costs over `size` ranks where they do not divide
    (None where they do): each rank computes ceil(heads / size) of them."""
    if heads % size == 0:
        return None
    per = -(-heads // size)
    return (
        f"{heads} attention heads over {size} ranks: each rank computes {per} (padded to "
        f"{per * size}; {per * size - heads} of zeros), the time of {per * size} heads"
    )
