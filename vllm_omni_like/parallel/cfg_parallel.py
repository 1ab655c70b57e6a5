"""CFG-parallel: the two guidance branches of every denoising step on two ranks (two GPUs).

Rank 0 (the leader) runs our own loop and its running set as one GPU would (stages/diffusion/
step.py): at each step the unconditional forward's inputs go to rank 1 (`LoopBranches`), rank 0
computes the conditional forward meanwhile, then takes rank 1's output back and combines the
two as the one-rank loop does. Where a mode runs the pipeline's call instead (the generic
family), the pipeline's denoiser is wrapped to the same effect (`SplitCFG`, `PairCFG`). Rank 1
runs no loop (`ServedBranches`: the loop's denoiser call, or the denoiser): between batches it
waits on its worker's pipe (no collective is open while a replica idles, so none can time out),
and during a batch it serves rank 0's calls until rank 0 says the batch's denoising ended
(`end`; a running set's groups end in any order).

Control flow is rank 0's alone: aborts, per-request errors, bisection and requests without
guidance (run on rank 0 alone) need no agreement between the ranks, and the two cannot drift
apart. Whatever breaks the exchange itself (a rank gone, an unexpected message) ends the
worker, and the executor restarts the replica as a whole; the process group's timeout is only a
backstop behind the executor's death and stall detection.

Transport (parallel/rank_link.py): torch.distributed point to point (NCCL on CUDA, gloo on the
CPU) for tensors, and a second, gloo (host memory) group for the small objects that steer the
exchange. Per step, rank 0 sends a header (the call's structure) over the host group and the
branch's tensors over the device group, and receives a status and the branch's output, all
outside any compiled region. The header travels host to host: rank 1 reads it as soon as rank
0's host reaches the step, not once rank 0's device has, so rank 1 launches its branch ahead of
the data it waits for (on the device), as rank 0 does; through the device group it would wait
for rank 0's previous step to end, then for its own launches (measured: 5.5 ms a step on
H200s).

What both ranks hold alike beside the models (`Replicated`: the LoRA pool) stays alike: each
slot rank 0 writes goes to rank 1 as it is written ("share"), in order with the calls, and each
of our own loop's forwards carries what rank 1 sets around it (its rows' adapters).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from vllm_omni_like.errors import is_fatal_device_error, is_out_of_memory
from vllm_omni_like.parallel.branches import BatchedCFG, DenoiserWrapper
from vllm_omni_like.parallel.rank_link import (
    BatchEnds,
    Link,
    RankDiverged,
    Replicated,
    Spec,
    map_leaves,
    pack_args,
    shape_key,
    tensor_spec,
    unpack_args,
)

logger = logging.getLogger(__name__)
T = TypeVar("T")
WARM_UP = -1  # the batch id of the compile warm-up, which rank 0 drives at load


class PeerOutOfMemory(MemoryError):
    """Rank 1 ran out of memory on its branch (a request's error, like a local OOM)."""


class PeerFailed(RuntimeError):
    """Rank 1's branch raised (a request's error)."""


OK, FAILED, OUT_OF_MEMORY = 0, 1, 2  # rank 1's status of one branch call


class Leader:
    """Rank 0's side: a branch runs on rank 1 while rank 0 computes its own.

    The first call of each shape of inputs (once per replica: the warm-up's or the first
    request's) waits for rank 1's status, which carries the output's shape, and both ranks
    remember it; every other call only posts its receives, so no step waits on the host for
    rank 1 (the device waits, where the output is used): the ranks' host work per step (the
    scheduler, callbacks, launches) stays hidden behind the device's, as on one GPU. Their
    statuses are read once, in `settle`, after the pipeline call."""

    def __init__(
        self,
        link: Link,
        mark: Callable[[str], None] = lambda label: None,
        replicated: Replicated | None = None,
    ) -> None:
        self.link = link
        self.mark = mark  # called as the local branch starts and ends (stages/trace.py)
        self.outputs: dict[tuple, Spec] = {}  # the output's spec for each shape of the inputs
        self.statuses: list[torch.Tensor] = []
        self.passed: list[torch.Tensor] = []  # the previous call's tensors, which rank 1 holds
        self.replicated = replicated  # (the LoRA pool: each slot written here goes to rank 1)
        if replicated is not None:
            replicated.on_write(self.share)

    def arm(self) -> None:
        self.statuses, self.passed = [], []

    def alongside(self, local: Callable[[], T], args: tuple, kwargs: dict) -> tuple[T, Any]:
        """`local()` here while rank 1 runs the model on (args, kwargs); both outputs."""
        tensors: list[torch.Tensor] = []
        every: list[torch.Tensor] = []
        kept = {id(t): i for i, t in enumerate(self.passed)}
        meta = pack_args((args, kwargs), tensors, every, kept)
        self.passed = every
        key = shape_key(args, kwargs, every)
        expect = self.outputs.get(key)
        self.link.send_obj(("call", meta, [tensor_spec(t) for t in tensors], expect is None))
        for t in tensors:
            self.link.send(t)
        try:
            self.mark("local")
            mine = local()
            self.mark("local_done")
        except BaseException as exc:
            if not is_fatal_device_error(exc):
                self._collect(key, expect)  # rank 1's answer still comes: take it, then fail
            raise
        return mine, self._collect(key, expect)

    def _collect(self, key: tuple, expect: Spec | None) -> torch.Tensor:
        if expect is not None:
            status = self.link.recv((1,), "int64")
            self.statuses.append(status)
            return self.link.recv(*expect)
        match self.link.recv_obj():
            case ("ok", shape, dtype):
                self.outputs[key] = (tuple(shape), dtype)
                return self.link.recv(shape, dtype)
            case ("error", code, text):
                raise (PeerOutOfMemory if code == OUT_OF_MEMORY else PeerFailed)(
                    f"CFG-parallel rank 1: {text}"
                )
            case other:
                raise RankDiverged(f"rank 1 answered {other!r:.200}")

    def settle(self) -> None:
        """Raise if any of rank 1's branches since `arm` failed (its log says how)."""
        self.passed = []
        self.check()

    def check(self) -> None:
        """Raise if any of rank 1's branches since the last check failed (our own loop checks
        each step's: a failed step is bisected; the tensors it passed stay rank 1's)."""
        statuses, self.statuses = self.statuses, []
        codes = set(torch.cat(statuses).tolist()) if statuses else set()
        if OUT_OF_MEMORY in codes:
            raise PeerOutOfMemory("CFG-parallel rank 1 ran out of memory on its branch")
        if FAILED in codes:
            raise PeerFailed("CFG-parallel rank 1's branch failed (its log in the server's)")

    def share(self, key: Any) -> None:
        """The replicated state's buffers of `key`, just written here, into rank 1's (before
        any later call, which may read them)."""
        assert self.replicated is not None
        buffers = self.replicated.buffers(key)
        self.link.send_obj(("share", key, [tensor_spec(t) for t in buffers]))
        for t in buffers:
            self.link.send(t)

    def end(self, batch_id: int) -> None:
        self.link.send_obj(("end", batch_id))


class Follower:
    """Rank 1's side: serves rank 0's branch calls batch after batch, remembering each shape
    of inputs' output spec as rank 0 does (see `Leader`)."""

    def __init__(self, link: Link, replicated: Replicated | None = None) -> None:
        self.link = link
        self.replicated = replicated  # (rank 0's slots copied into it, as it writes them)
        self.outputs: dict[tuple, Spec] = {}
        # the previous call's tensors (its kept ones come again, in the next batch too: our
        # own loop's running set steps on across its batches' ends)
        self.held: list[torch.Tensor] = []
        self.ends = BatchEnds()

    def serve(
        self, model: Any, batch_id: int, mark: Callable[[str], None] = lambda label: None
    ) -> None:
        """Run rank 0's branch calls on `model` until it ends batch `batch_id`. A call of a new
        shape answers with a status object (the output's shape); others with a status tensor
        and an output of the remembered shape (zeros after a failure, which rank 0's `settle`
        reports). `mark` is called as each branch starts and ends (stages/trace.py). Batch ends
        in another order than the batches': rank_link.BatchEnds."""
        link = self.link
        for message in self.ends.messages(link, batch_id):
            match message:
                case ("call", meta, specs, first):
                    args, kwargs, every = self._received(meta, specs)
                case ("share", key, specs):
                    self._share(key, specs)
                    continue
                case other:
                    raise RankDiverged(f"serving batch {batch_id}, rank 0 sent {other!r:.200}")
            key = shape_key(args, kwargs, every)
            expect = self.outputs.get(key)
            if not first and expect is None:
                raise RankDiverged(f"rank 0 expects an output for inputs {key!r:.200} unseen here")
            code, out, text = self._branch(model, args, kwargs, batch_id, mark)
            if first:
                if out is None:
                    link.send_obj(("error", code, text))
                    continue
                self.outputs[key] = tensor_spec(out)
                link.send_obj(("ok", *self.outputs[key]))
                link.send(out)
                continue
            assert expect is not None
            if out is not None and tensor_spec(out) != expect:
                code, out = FAILED, None
                logger.warning("CFG-parallel rank 1: an output's shape changed for one input's")
            link.send(link.code(code))
            if out is None:
                out = torch.zeros(expect[0], dtype=getattr(torch, expect[1]), device=link.device)
            link.send(out)
            del out, args, kwargs, every

    def _received(self, meta: Any, specs: list) -> tuple[tuple, dict, list[torch.Tensor]]:
        """A call's arguments: its new tensors received, its kept ones the previous call's."""
        tensors = [self.link.recv(shape, dtype) for shape, dtype in specs]
        every: list[torch.Tensor] = []
        args, kwargs = unpack_args(meta, tensors, every, self.held)
        self.held = every
        return args, kwargs, every

    def _share(self, key: Any, specs: list) -> None:
        """Rank 0's buffers of `key` into this rank's, as it wrote them (then on into this
        rank's sequence-parallel group's, where it leads one)."""
        buffers = [] if self.replicated is None else self.replicated.buffers(key)
        if [tensor_spec(t) for t in buffers] != specs:
            raise RankDiverged(f"rank 0 shares {key!r} in buffers this rank does not hold alike")
        with torch.inference_mode():
            for t in buffers:
                self.link.recv_into(t)
        assert self.replicated is not None
        self.replicated.copied(key)

    def _branch(
        self, model: Any, args: tuple, kwargs: dict, batch_id: int, mark: Callable[[str], None]
    ) -> tuple[int, torch.Tensor | None, str]:
        """One branch: its status, output (None after a failure) and the failure's text."""
        try:
            mark("branch")
            with torch.inference_mode():
                out = model(*args, **kwargs)[0]
            mark("done")
            return OK, out, ""
        except Exception as exc:
            if is_fatal_device_error(exc):
                raise
            code = OUT_OF_MEMORY if is_out_of_memory(exc) else FAILED
            if code == OUT_OF_MEMORY and torch.cuda.is_available():
                torch.cuda.empty_cache()
            logger.warning("CFG-parallel rank 1: the branch of batch %d raised %r", batch_id, exc)
            return code, None, f"{type(exc).__name__}: {exc}"


LOOP_CALL = "loop_inputs"  # the keyword that marks our own loop's forward (not a denoiser's)


@dataclass(frozen=True)
class _OnHost:
    """A tensor kept on the host (Z-Image's token counts) where the ranks' tensors go through
    the device: it travels in the header."""

    tensor: torch.Tensor


class LoopBranches:
    """Rank 0 of our own loop (stages/diffusion/step.py): a step's unconditional forward, its
    inputs padded to its bucket as a forward here pads them, runs on rank 1 while the
    conditional one runs here; rank 1's status is checked before the step goes on, so a
    failed branch fails the step (which the running set bisects), not a later one."""

    def __init__(self, leader: Leader) -> None:
        self.leader = leader

    def alongside(self, local: Callable[[], T], inputs: dict, at: list[float] | None) -> tuple:
        """`local()` here while rank 1 runs `inputs` (host timesteps `at`; its LoRA rows among
        them); both outputs."""
        device = self.leader.link.device
        host = lambda t: _OnHost(t) if t.device != device else t  # noqa: E731
        sent = map_leaves(inputs, lambda v: host(v) if isinstance(v, torch.Tensor) else v)
        self.leader.statuses.clear()  # (a failed step's, whose status nobody read)
        mine, theirs = self.leader.alongside(local, (), {LOOP_CALL: sent, "at": at})
        self.leader.check()
        return mine, theirs


class ServedBranches:
    """What rank 1 runs for rank 0: our own loop's unconditional forward (`loop`: the
    adapter's call on its inputs, stages/diffusion/step.py) or, where a mode runs the
    pipeline's call, the denoiser's branch (`denoiser`)."""

    def __init__(self, denoiser: Any, loop: Callable[[dict, list[float] | None], Any]) -> None:
        self.denoiser = denoiser
        self.loop = loop

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if LOOP_CALL not in kwargs:
            return self.denoiser(*args, **kwargs)
        unwrap = lambda v: v.tensor if isinstance(v, _OnHost) else v  # noqa: E731
        return (self.loop(map_leaves(kwargs[LOOP_CALL], unwrap), kwargs["at"]),)


class SplitCFG(DenoiserWrapper):
    """A pipeline's doubled guidance batch of one call (a UNet's or SD3's transformer's:
    negative half, then positive)
    over two ranks: rank 1 runs the first half, rank 0 the second. Armed with the doubled
    batch's rows; any other call (no guidance, another batch size) runs here whole."""

    needs_embeddings = False

    def __init__(self, model: torch.nn.Module, leader: Leader) -> None:
        super().__init__(model)
        self.leader = leader
        self.rows = 0

    def arm(self, kwargs: dict[str, Any]) -> None:
        self.rows = 2 * len(kwargs["generator"])
        self.leader.arm()

    def settle(self) -> None:
        self.leader.settle()

    def disarm(self) -> None:
        self.rows = 0

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        sample = args[0] if args else kwargs.get("sample", kwargs.get("hidden_states"))
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

    def cut(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == rows:
            return leaf[part]
        return leaf

    return map_leaves(value, cut)


class PairCFG(BatchedCFG):
    """A pipeline that calls its denoiser once per branch (Wan's): the conditional call runs here
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


def keep_only(pipe: Any, keep: set[str]) -> list[str]:
    """Rank 1: drop every model of the pipeline but those named in `keep` (its denoisers; text
    encoders, VAE: a Wan text encoder alone is 11 GB in 16 bits); the names dropped."""
    dropped = [
        name
        for name, part in pipe.components.items()
        if name not in keep and isinstance(part, torch.nn.Module)
    ]
    for name in dropped:
        setattr(pipe, name, None)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return dropped
