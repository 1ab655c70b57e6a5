"""The adapter's contract for rows that carry their own conditioning from an image: our loop's
instruction edits (Qwen-Image-Edit) and image-to-video rows (Wan2.1-I2V, Wan2.2-I2V-A14B,
Wan2.2-TI2V's first frame). `Adapter` (models/adapter.py) takes it in; a family overrides it.

A row from an image carries tensors of its own beside its latents (`condition`: the upload's
latents, a first frame's condition and mask, CLIP features), made once when it joins. Our loop
keeps them row by row, as it keeps the latents (stages/diffusion/rows.py), and hands each
forward those of its model rows, both CFG branches alike as the pipelines pass them
(`predict_conditioned`); after a step it puts back what the conditioning fixes (`put_back`:
TI2V's first frame). Where rows from text share a forward with rows from an image, every row
carries a conditioning (a text row's fixes nothing). Where the family's text reads the image too
(Qwen2.5-VL: the upload's vision tokens among the prompt's), a text row is its prompt's with
its upload (`text_reads_image`, `encode_text_with_images`).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

# a row's own conditioning (or a batch's, row by row): named tensors with rows first
Conditioning = dict[str, torch.Tensor]


class RowConditions:
    """The defaults: no row carries a conditioning of its own."""

    conditioned: ClassVar[bool] = False  # every row of our loop carries one (`condition`)
    text_reads_image: ClassVar[bool] = False  # a row's text is read with its image

    def encode_text_with_images(
        self, texts: list[str | None], images: list[Any], device: torch.device
    ) -> Any:
        """Text conditioning as `encode_text` makes it, each text read with its row's image
        (`images`, one a text: PIL images as the stage hands them over)."""
        raise NotImplementedError(f"{type(self).__name__}: its text reads no image")

    def condition(
        self, image: Any, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> Conditioning:
        """One row's conditioning (each tensor one row) from its image (a PIL image; None: a
        row from text, in a family whose rows from text and from an image share a forward),
        as the pipeline makes it beside latents of `shape` (one row) in `dtype`, drawing no
        random numbers."""
        raise NotImplementedError(f"{type(self).__name__}: no row conditioning of its own")

    def predict_conditioned(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text: Any,
        conditioning: Conditioning,
        at: Any = None,
    ) -> Any:
        """`predict` for model rows that carry their own conditioning (one row of it each)."""
        raise NotImplementedError(f"{type(self).__name__}: no row conditioning of its own")

    def takes_mask(self) -> bool:
        """Whether the denoiser takes an inpainting row's mask and masked image's latents
        beside its latents (a 9-channel inpainting UNet): its rows' conditioning is those
        (`{"mask", "masked_image"}`, made by the stage as the inpainting pipeline makes them,
        stages/diffusion/edit_rows.py), handed to `predict_conditioned`; nothing is put back."""
        return False

    def put_back(self, latents: torch.Tensor, conditioning: Conditioning) -> torch.Tensor:
        """The rows' latents with what their conditioning fixes put back (after each step, and
        on joining): as they are by default."""
        return latents
