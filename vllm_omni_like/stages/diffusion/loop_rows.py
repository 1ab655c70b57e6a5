"""The own loop's records (step.py): a row, a step's plan over the active rows, and what a
request leaves unsaid (the stage's defaults)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni_like.models import row_schedulers as rs
from vllm_omni_like.models.row_conditions import Conditioning
from vllm_omni_like.stages.diffusion.block_cache import RowCache
from vllm_omni_like.stages.diffusion.edit_rows import Anchor, Source
from vllm_omni_like.stages.diffusion.lora_pool import LoraRows, Selection
from vllm_omni_like.stages.diffusion.row_tensors import Text
from vllm_omni_like.wire import StageRequest

# texts -> their conditioning on the device; None: a negative prompt not given (SDXL: zeros);
# the images the texts are read with, one a text, where the family's text reads them (else None)
Embed = Callable[[list[str | None], list[Any] | None], Text]
# a text row's: its text, and the request whose image it is read with (None: none)
TextKey = tuple[str | None, str | None]


@dataclass
class LoopRow:
    request: StageRequest
    seed: int
    guidance: float
    state: rs.Row
    text: int  # its prompt's row of the batch's embeddings
    negative: int | None  # its negative prompt's (a row with guidance), else None
    guidance_2: float | None = None  # the low-noise expert's scale (two experts), else None
    # an edit row's upload until its latents are made (`noise`), else None
    source: Source | None = None
    anchor: Anchor | None = None  # an inpainting row's: what each step puts back
    # a mask-taking denoiser's inpainting row: its mask and masked image's latents
    mask_input: Conditioning | None = None
    # the image a row is conditioned on (an instruction edit's upload, an image-to-video
    # request's first frame) until its conditioning is made (`conditions`), else None
    image: Any | None = None
    lora: Selection = ()  # its LoRA adapters' (pool slot, scale), held while in the set
    cache: RowCache | None = None  # its step cache (a stage with --cache), else None

    @property
    def cfg(self) -> bool:
        return self.negative is not None


@dataclass
class Plan:
    """A step's reusables for one set of active rows (made again when the set changes)."""

    active: list[int]
    group: list[LoopRow]
    index: torch.Tensor | None  # the active rows among the batch's (None: all)
    cfg: list[int]  # the positions among them with guidance
    cfg_index: torch.Tensor | None  # those on the device (None: all, or none)
    texts: Text  # the model rows' text (with batched CFG: both branches')
    negatives: Text | None  # two forwards: the unconditional branch's
    scale: float | torch.Tensor  # one guidance scale, or a column of them (1: no guidance)
    embedded: torch.Tensor | None = None  # a DISTILLED family's: each row's scale (float32)
    # two experts: each guided row's (scale, the low-noise expert's), where one differs
    by_expert: list[tuple[float, float]] | None = None
    anchor: Anchor | None = None  # inpainting rows': what each step puts back (others: none)
    # rows from an image: the model rows' own conditioning (with batched CFG: both branches');
    # two forwards: the unconditional branch's; the rows' own (what a step puts back)
    conditioning: Conditioning | None = None
    negative_conditioning: Conditioning | None = None
    put_back: Conditioning | None = None
    # LoRA: the model rows' (with batched CFG: both branches'); two forwards: the uncond's
    lora: LoraRows | None = None
    negative_lora: LoraRows | None = None

    def cache_slots(self, branch: int = 0) -> list[tuple[RowCache | None, int]]:
        """Each model row's step cache and branch: every row's conditional one (0), or the
        unconditional one (1) of the rows with guidance."""
        rows = self.group if branch == 0 else [self.group[j] for j in self.cfg]
        return [(r.cache, branch) for r in rows]


@dataclass(frozen=True)
class Settings:
    """What a request leaves unsaid: the stage's defaults."""

    steps: int
    guidance: float
    rows_per_request: Callable[[StageRequest], int]
    prompt: Callable[[StageRequest], str] = lambda request: request.prompt  # (truncated)
    # an edit's upload (and mask) at the batch's (width, height); None: a row from noise
    source: Callable[[StageRequest, tuple[int, int]], Source | None] = lambda r, s: None
    # the image a request's rows are conditioned on at the batch's (width, height); None: none
    image: Callable[[StageRequest, tuple[int, int]], Any | None] = lambda r, s: None
