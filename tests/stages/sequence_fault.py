"""A diffusion stage for the sequence-parallel death tests, imported by 'module:Class' in its
workers: one rank fails in the middle of a forward's attention exchange, once.

The test arms it with a file `armed-<rank>-<kind>` in $SEQUENCE_FAULT_DIR (kind: `kill` or
`oom`). At the first attention of a forward over `FAULT_TOKENS` tokens, every other rank writes
`entered-<rank>` and goes into the all-to-all; the victim waits until they all have, takes the
file away (the fault fires once: the restarted replica runs clean), writes `failed` (its
monotonic clock) and then SIGKILLs itself (`kill`) or raises an out-of-memory error (`oom`: its
worker exits, as a failure inside a forward's collectives must). The others' exchange then
fails (gloo: `raised-<rank>`) or waits (NCCL would): either way they then hang, as NCCL leaves
a rank whose peer died, so only the executor's monitor can end them."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from vllm_omni_like.stages.diffusion.stage import DiffusionStage

FAULT_ENV = "SEQUENCE_FAULT_DIR"
FAULT_TOKENS = 240  # tiny-video at 64x48, 9 frames: 5 x 6 x 8 latent tokens


def sequence_shards(models: dict[str, Any]) -> Any:
    """The `SequenceShards` the denoisers' attention processors share."""
    for model in models.values():
        for module in model.modules():
            shards = getattr(getattr(module, "processor", None), "shards", None)
            if shards is not None:
                return shards
    raise AssertionError("no sequence-parallel attention in the denoisers")


def _write(path: str, text: str = "") -> None:
    with open(path, "w") as f:
        f.write(text)


class SequenceFaultStage(DiffusionStage):
    def load(self, device: str) -> None:
        super().load(device)
        where, rank, size = os.environ[FAULT_ENV], self.ranks.rank, self.ranks.size
        assert self.runtime.seq_ranks is not None
        shards = sequence_shards(self.runtime.seq_ranks.models)
        attention = shards.attention

        def fail(armed: str, kind: str) -> None:
            others = [os.path.join(where, f"entered-{r}") for r in range(size) if r != rank]
            deadline = time.monotonic() + 10
            while not all(map(os.path.exists, others)) and time.monotonic() < deadline:
                time.sleep(0.005)
            os.rename(os.path.join(where, armed), os.path.join(where, f"fired-{armed}"))
            _write(os.path.join(where, "failed"), repr(time.monotonic()))
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise MemoryError(f"simulated out of memory on rank {rank} during an all-to-all")

        def faulty(q: Any, k: Any, v: Any, replicated: int = 0, attend: Any = None) -> Any:
            armed = [f for f in os.listdir(where) if f.startswith("armed-")]
            if shards.length != FAULT_TOKENS or not armed:
                return attention(q, k, v, replicated, attend)
            _, victim, kind = armed[0].split("-")
            if int(victim) == rank:
                fail(armed[0], kind)
            _write(os.path.join(where, f"entered-{rank}"))
            try:
                return attention(q, k, v, replicated, attend)
            except Exception:
                _write(os.path.join(where, f"raised-{rank}"))
                threading.Event().wait()  # as NCCL leaves a rank whose peer died: waiting

        shards.attention = faulty
