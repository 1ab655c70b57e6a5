"""Reads a generated image back: background, shape colour, position, class, and a clip's motion."""

from __future__ import annotations

import numpy as np

from vllm_omni_like.shapes.world import PAINTS, POSITIONS, SHAPES

_NAMES = list(PAINTS)  # (the base's colours and the adapters')
_PALETTE = np.array([PAINTS[c] for c in _NAMES], np.float32)


def nearest_colour(rgb: np.ndarray) -> str:
    return _NAMES[int(np.argmin(((_PALETTE - rgb) ** 2).sum(axis=1)))]


def _foreground(image: np.ndarray) -> tuple[str, np.ndarray]:
    img = image.astype(np.float32)
    border = np.concatenate([img[0], img[-1], img[:, 0], img[:, -1]])
    background = nearest_colour(np.median(border, axis=0))
    distance = np.sqrt(((img - np.array(PAINTS[background], np.float32)) ** 2).sum(axis=-1))
    return background, distance > 60


def read_image(image: np.ndarray) -> dict[str, str | None]:
    """What the picture shows, attribute by attribute (None where nothing can be read)."""
    background, mask = _foreground(image)
    found: dict[str, str | None] = {
        "background": background,
        "colour": None,
        "position": None,
        "shape": None,
    }
    if mask.sum() < 12:
        return found
    n = image.shape[0]
    found["colour"] = nearest_colour(np.median(image[mask].astype(np.float32), axis=0))
    ys, xs = np.nonzero(mask)
    col, row = min(2, int(xs.mean() / n * 3)), min(2, int(ys.mean() / n * 3))
    found["position"] = POSITIONS[row * 3 + col]
    box = (ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1)
    fill = mask.sum() / box
    found["shape"] = "square" if fill > 0.94 else "circle" if fill > 0.7 else _pointed(mask)
    return found


def _pointed(mask: np.ndarray) -> str:
    """A half-filled box: a triangle widens to its base, a diamond narrows again (its lowest
    fifth far narrower than its widest row)."""
    ys = np.nonzero(mask.any(axis=1))[0]
    widths = mask[ys.min() : ys.max() + 1].sum(axis=1)
    low = widths[-max(1, len(widths) // 5) :].mean()
    return "diamond" if low < 0.6 * widths.max() else "triangle"


def score(expected: dict[str, str], read: dict[str, str | None]) -> dict[str, bool]:
    return {k: read.get(k) == v for k, v in expected.items()}


def accuracy(pairs: list[tuple[dict[str, str], np.ndarray]]) -> dict[str, float]:
    """Per-attribute accuracy over (expected attributes, image) pairs."""
    hits: dict[str, list[bool]] = {}
    for expected, image in pairs:
        for k, ok in score(expected, read_image(image)).items():
            hits.setdefault(k, []).append(ok)
    return {k: sum(v) / len(v) for k, v in hits.items()}


def motion(frames: np.ndarray) -> str | None:
    """The direction the shape's centroid moves over the clip."""
    centres = []
    for frame in frames:
        _, mask = _foreground(frame)
        if mask.sum() < 8:
            continue
        ys, xs = np.nonzero(mask)
        centres.append((xs.mean(), ys.mean()))
    if len(centres) < 2:
        return None
    dx, dy = np.subtract(centres[-1], centres[0])
    if max(abs(dx), abs(dy)) < frames.shape[2] * 0.1:
        return None
    if abs(dx) >= abs(dy):
        return "right" if dx > 0 else "left"
    return "down" if dy > 0 else "up"


__all__ = ["SHAPES", "accuracy", "motion", "nearest_colour", "read_image", "score"]
