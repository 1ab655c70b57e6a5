"""Where a worker stands in its replica (the ranks of a CFG-parallel replica meet by it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ranks:
    """Where a worker stands in its replica: rank `rank` of `size`; ranks that work together
    (CFG-parallel) meet through the file `rendezvous` (torch.distributed's FileStore)."""

    rank: int = 0
    size: int = 1
    rendezvous: str = ""
