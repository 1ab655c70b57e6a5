"""Rows that start from an image (stages/diffusion/step.py's edits): image-to-image and
inpainting, as the diffusers pipelines make them.

A row's `Source` is its upload as the pipeline preprocesses it (and, inpainting, its mask). When
the rows' latents are made, each source is encoded by the VAE with the row's own generator
before its noise is drawn (the pipelines' order of draws), then noised to the row's first step
(`row_schedulers.add_noise`); an inpainting row at strength 1 starts from noise alone, as
SD's inpainting pipeline starts. An inpainting row keeps an `Anchor` (its image's latents, its
noise, its mask at the latents' size): after each step its unmasked region is put back to its
image noised to the next step (the last step: the image itself), `(1 - m) x_t + m latents`, as
the inpainting pipelines of a denoiser without mask channels do. A denoiser with mask channels
(a 9-channel inpainting UNet, `Adapter.takes_mask`) puts nothing back: its row carries its mask
at the latents' size and its masked image's latents (the VAE's sample with the row's generator,
drawn after the noise) as its conditioning (`LoopRow.mask_input`), and its image is encoded
only where the row starts from it (a strength below 1), as the diffusers SD inpainting pipeline
draws."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni_like.models import row_schedulers as rs
from vllm_omni_like.models.columns import column, mul, to_device


@dataclass
class Source:
    """An edit's upload (1, 3, H, W in [-1, 1]) and, inpainting, its mask (1, 1, H, W in
    [0, 1], 1: repaint), as its pipeline's processors make them."""

    pixels: torch.Tensor
    mask: torch.Tensor | None = None
    strength: float = 1.0  # (the row's: set when its schedule is made)
    latents: Any = None  # its pixels' latents, once encoded (`encode_sources`)
    masked: Any = None  # a mask-taking denoiser's: its masked image's latents (`masked_images`)


@dataclass
class Anchor:
    """An inpainting row's image latents, initial noise and mask at the latents' size."""

    image: torch.Tensor
    noise: torch.Tensor
    mask: torch.Tensor


def first_latents(adapter: Any, rows: list[Any], noise: torch.Tensor) -> torch.Tensor:
    """The rows' first latents from their `noise` (drawn by the caller after
    `encode_sources`): a row from noise alone scaled by its scheduler's initial sigma, an
    edit's source latents noised to its first step; an inpainting row keeps its anchor (a
    mask-taking denoiser's: its mask input)."""
    sources: dict[int, torch.Tensor] = {}
    for i, r in enumerate(rows):
        if r.source is None:
            continue
        image, mask = r.source.latents, r.source.mask
        if mask is not None:
            mask = torch.nn.functional.interpolate(mask, size=tuple(noise.shape[-2:]))
            if r.source.masked is not None:
                masked = r.source.masked.to(noise.dtype)
                r.mask_input = {"mask": mask.to(noise.dtype), "masked_image": masked}
            else:
                r.anchor = Anchor(image, noise[i : i + 1].clone(), mask.to(noise.dtype))
        if mask is None or r.source.strength < 1.0:  # (inpainting at 1: noise alone)
            sources[i] = image
    sigma = [1.0 if i in sources else r.state.schedule.init_noise_sigma for i, r in enumerate(rows)]
    latents = noise
    if any(s != 1.0 for s in sigma):  # (as a pipeline scales by its scheduler's)
        latents = mul(column(sigma, latents), latents)
    by_schedule: dict[int, list[int]] = {}
    for i in sources:
        by_schedule.setdefault(id(rows[i].state.schedule), []).append(i)
    for picked in by_schedule.values():  # (rows of one schedule noised together)
        source = torch.cat([sources[i] for i in picked])
        index = to_device(torch.tensor(picked), latents.device)
        out = rs.add_noise(rows[picked[0]].state.schedule, source, latents[index])
        latents[index] = out.to(latents.dtype)
    for r in rows:
        r.source = None  # (its pixels and latents are no longer needed)
    return latents


def encode_sources(adapter: Any, rows: list[Any]) -> None:
    """Each edit row's source encoded with its own generator (`Source.latents`), before its
    noise is drawn, as the pipelines draw (a mask-taking denoiser's inpainting pipeline
    encodes no image for a row that starts from noise alone)."""
    takes_mask = adapter.takes_mask()
    for r in rows:
        if r.source is None:
            continue
        s = r.source
        if not (takes_mask and s.mask is not None and s.strength >= 1.0):
            s.latents = adapter.encode_image(s.pixels, r.state.generator)


def masked_images(adapter: Any, rows: list[Any]) -> None:
    """After the noise: each inpainting row's masked image (`image * (mask < 0.5)`) through the
    VAE with the row's generator, as its pipeline's `prepare_mask_latents` makes it: a
    mask-taking denoiser's input (`Source.masked`); for another denoiser only the draw, so the
    row's generator is where the pipeline's is for an ancestral step's noise."""
    takes_mask = adapter.takes_mask()
    for r in rows:
        s = r.source
        if s is None or s.mask is None:
            continue
        if takes_mask:
            s.masked = adapter.encode_image(s.pixels * (s.mask < 0.5), r.state.generator)
        else:
            _masked_image_draw(s.latents, r.state.generator)


def _masked_image_draw(image: torch.Tensor, generator: torch.Generator | None) -> None:
    """The generator's draw for the masked image's VAE sample (one of the latents' shape)."""
    from diffusers.utils.torch_utils import randn_tensor

    randn_tensor(tuple(image.shape), generator=generator, device=image.device, dtype=image.dtype)


def anchors_of(group: list[Any], like: torch.Tensor) -> Anchor | None:
    """The group's anchors as one batch (a row without one: mask 1, nothing put back)."""
    if all(r.anchor is None for r in group):
        return None
    ones = torch.ones_like(like[:1, :1])
    zeros = torch.zeros_like(like[:1])
    images, noises, masks = [], [], []
    for r in group:
        a = r.anchor
        images.append(zeros if a is None else a.image.to(like.dtype))
        noises.append(zeros if a is None else a.noise)
        masks.append(ones if a is None else a.mask)
    return Anchor(torch.cat(images), torch.cat(noises), torch.cat(masks))


def blend(states: list[rs.Row], anchor: Anchor, latents: torch.Tensor) -> torch.Tensor:
    """After a step (`states` at their next positions): each row's unmasked region back to its
    image noised to its next step, or its image itself after its last."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, s in enumerate(states):
        groups.setdefault((id(s.schedule), s.index), []).append(i)
    proper = anchor.image
    if len(groups) == 1:
        proper = _noised(states[0], anchor.image, anchor.noise)
    else:
        proper = anchor.image.clone()
        for picked in groups.values():
            index = to_device(torch.tensor(picked), latents.device)
            part = _noised(states[picked[0]], anchor.image[index], anchor.noise[index])
            proper[index] = part.to(proper.dtype)
    return (1 - anchor.mask) * proper + anchor.mask * latents


def _noised(state: rs.Row, image: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    if state.done:  # (after the last step: the image itself)
        return image
    return rs.noise_to(state.schedule, state.index, image, noise)
