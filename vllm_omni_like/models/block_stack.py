"""A denoiser's blocks as the step cache sees them: a family's own description.

First-Block Cache (stages/diffusion/block_cache.py) runs a transformer's first block on every
model row, and the rest of its blocks only on the rows whose first block's residual changed
enough since they last ran them; the others reuse the residual the rest added then. What that
needs of a model is the family's knowledge, given here as data: which module lists hold the
blocks (in the order the forward calls them), the names of a block call's arguments (in their
positional order), which it carries from block to block and returns, which other ones have a
row each (gathered with the rows that run), and the one whose residual is measured and cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_omni_like.errors import ConfigError


@dataclass(frozen=True)
class BlockStack:
    """The blocks of one denoiser (`lists`: its ModuleLists in call order, all called alike)."""

    lists: tuple[Any, ...]
    params: tuple[str, ...]  # a block call's argument names, in positional order
    returns: tuple[str, ...]  # what a block returns, in order (one name: returned alone)
    per_row: tuple[str, ...]  # the other arguments with one row a model row (else shared)
    hidden: str = "hidden_states"  # the carried state whose residual is measured and cached

    def __post_init__(self) -> None:
        assert self.hidden in self.returns and set(self.returns) <= set(self.params)

    @property
    def blocks(self) -> list[Any]:
        return [block for blocks in self.lists for block in blocks]


def joint_stack(*lists: Any, per_row: tuple[str, ...] = ("temb",)) -> BlockStack:
    """The MMDiT families' dual-stream blocks (SD3, FLUX.1's both kinds, Qwen-Image): called
    by keyword, each returning (encoder_hidden_states, hidden_states)."""
    return BlockStack(
        lists=lists,
        params=("hidden_states", "encoder_hidden_states", *per_row),
        returns=("encoder_hidden_states", "hidden_states"),
        per_row=per_row,
    )


class StackedBlocks:
    """The adapter's part for the step cache: its denoiser's blocks (none by default)."""

    family: Any  # (the adapter's Family)

    def block_stack(self) -> BlockStack:
        """Its denoiser's blocks as the step cache sees them (a family without: refused)."""
        raise ConfigError(f"--cache first-block does not run the {self.family.name} family")
