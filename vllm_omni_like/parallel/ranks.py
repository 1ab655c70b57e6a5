"""Where a worker stands in its replica (the ranks of a CFG-parallel replica meet by it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ranks:
    """Where a worker stands in its replica: rank `rank` of `size`; ranks that work together
    (CFG-parallel, sequence parallel) meet through the file `rendezvous` (torch.distributed's
    FileStore). `sequence`: the ranks of a sequence-parallel group (consecutive: CFG-parallel x
    sequence parallel has two groups, the conditional branch's from rank 0, the unconditional
    one's from rank `sequence`)."""

    rank: int = 0
    size: int = 1
    rendezvous: str = ""
    sequence: int = 1
