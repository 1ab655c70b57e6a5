"""Scenes of a simple shape on a coloured background, their captions, renders and clips."""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

import numpy as np

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 220, 50),
    "purple": (140, 60, 190),
    "orange": (245, 140, 30),
    "white": (245, 245, 245),
    "black": (25, 25, 25),
}
SHAPES = ("circle", "square", "triangle")
# words the tokenizer has that the base model never saw drawn: a colour and a shape only the
# example LoRA adapters draw (training/train_lora.py); the checker reads them too
ADAPTER_COLOURS: dict[str, tuple[int, int, int]] = {"pink": (250, 130, 200)}
ADAPTER_SHAPES = ("diamond",)
PAINTS = {**COLOURS, **ADAPTER_COLOURS}  # every colour a render may take
POSITIONS = (
    "top left",
    "top",
    "top right",
    "left",
    "center",
    "right",
    "bottom left",
    "bottom",
    "bottom right",
)
SIZES = {"small": 0.14, "large": 0.22}  # half-extent as a fraction of the side
DIRECTIONS = ("left", "right", "up", "down")
SUPERSAMPLE = 4


@dataclass(frozen=True)
class Scene:
    shape: str
    colour: str
    position: str
    background: str
    size: str = "large"

    def caption(self) -> str:
        where = "in the center" if self.position == "center" else f"at the {self.position}"
        return f"a {self.size} {self.colour} {self.shape} {where} on a {self.background} background"

    @property
    def held_out(self) -> bool:
        """One combination in ten never appears in training (for the held-out evaluation)."""
        key = f"{self.colour}|{self.shape}|{self.position}|{self.background}".encode()
        return hashlib.sha256(key).digest()[0] % 10 == 0


@dataclass(frozen=True)
class Clip:
    shape: str
    colour: str
    background: str
    direction: str

    def caption(self) -> str:
        return (
            f"a {self.colour} {self.shape} moving {self.direction} on a {self.background} "
            "background"
        )


_CAPTION = re.compile(
    r"^a (small|large) (\w+) (\w+) (?:at the ([a-z ]+?)|in the center) on an? (\w+) background$"
)


def caption_grammar() -> str:
    """What the rewriter may write, as a Lark grammar (stages/llm/guided.py): a caption of the
    world's language, or the outside answer (the tokenizer's special token `<outside>`). It
    keeps the syntax and the vocabulary; that a shape's colour differs from its background is
    left to the model (and to `parse_caption`)."""
    colours = "|".join(COLOURS)
    where = "in the center|at the (" + "|".join(p for p in POSITIONS if p != "center") + ")"
    scene = (
        f"a ({'|'.join(SIZES)}) ({colours}) ({'|'.join(SHAPES)}) ({where}) "
        f"on a ({colours}) background"
    )
    return f"start: /{scene}/ | {OUTSIDE}"


def parse_caption(text: str) -> Scene | None:
    """A caption back to its scene, or None if it is not a valid one."""
    m = _CAPTION.match(text.strip().lower())
    if m is None:
        return None
    size, colour, shape, position, background = m.groups()
    position = position or "center"
    if (
        colour not in COLOURS
        or background not in COLOURS
        or colour == background
        or shape not in SHAPES
        or position not in POSITIONS
    ):
        return None
    return Scene(shape, colour, position, background, size)


# What the rewriter draws for what a prompt leaves out (or names with a word the world does not
# know): fixed, so a revised prompt is predictable and an unknown word is never guessed at.
DEFAULT_SIZE, DEFAULT_SHAPE, DEFAULT_POSITION = "large", "circle", "center"
DEFAULT_COLOUR, DEFAULT_BACKGROUND = "white", "black"
ATTRIBUTES = ("size", "colour", "shape", "position", "background")
OUTSIDE = "<outside>"  # the rewriter's whole answer to a prompt that names none of them


def scene_from_named(named: dict[str, str]) -> Scene:
    """The scene drawn for the attributes a prompt names (at least one), defaults elsewhere.

    The shape's colour defaults to white, the background to black; a default that would equal
    the other (named) colour takes the other default instead (white on white never happens).
    """
    if not named or set(named) - set(ATTRIBUTES):
        raise ValueError(f"named attributes must be some of {ATTRIBUTES}, not {named}")
    colour, background = named.get("colour"), named.get("background")
    if colour == background and colour is not None:
        raise ValueError(f"the shape and the background are both {colour}")
    if colour is None:
        colour = DEFAULT_COLOUR if background != DEFAULT_COLOUR else DEFAULT_BACKGROUND
    if background is None:
        background = DEFAULT_BACKGROUND if colour != DEFAULT_BACKGROUND else DEFAULT_COLOUR
    return Scene(
        named.get("shape", DEFAULT_SHAPE),
        colour,
        named.get("position", DEFAULT_POSITION),
        background,
        named.get("size", DEFAULT_SIZE),
    )


def describe() -> str:
    """What the world can draw, in one sentence (the answer to a prompt outside it)."""
    return (
        f"one {', '.join(SHAPES[:-1])} or {SHAPES[-1]}, small or large, coloured "
        f"{', '.join(list(COLOURS)[:-1])} or {list(COLOURS)[-1]}, at the {', '.join(POSITIONS)}"
        ", on a background of another of those colours"
    )


def sample_scene(rng: random.Random, held_out: bool | None = False) -> Scene:
    """A random scene; held_out=False never gives a held-out combination, True only those."""
    while True:
        colour, background = rng.sample(list(COLOURS), 2)
        scene = Scene(
            rng.choice(SHAPES), colour, rng.choice(POSITIONS), background, rng.choice(list(SIZES))
        )
        if held_out is None or scene.held_out == held_out:
            return scene


def short_prompt(scene: Scene, rng: random.Random) -> str:
    """What a user types: the colour and shape, sometimes a place, a size or a background."""
    words = [scene.colour, scene.shape]
    if rng.random() < 0.3:
        words.insert(0, scene.size)
    if rng.random() < 0.5:
        words.append(scene.position)
    if rng.random() < 0.5:
        words.append(f"on {scene.background}")
    return " ".join(words)


def short_prompt_attributes(prompt: str) -> dict[str, str]:
    """The attributes a short prompt fixes (what the rewriter must keep)."""
    words = prompt.lower().split()
    found: dict[str, str] = {}
    if "on" in words and words.index("on") + 1 < len(words):
        found["background"] = words[words.index("on") + 1]
        words = words[: words.index("on")]
    text = " ".join(words)
    for pos in sorted(POSITIONS, key=len, reverse=True):
        if text.endswith(" " + pos):
            found["position"] = pos
            text = text[: -len(pos) - 1]
            break
    for w in text.split():
        if w in SIZES:
            found["size"] = w
        elif w in COLOURS:
            found["colour"] = w
        elif w in SHAPES:
            found["shape"] = w
    return found


def _centre(position: str) -> tuple[float, float]:
    row, col = divmod(POSITIONS.index(position), 3)
    return (col + 0.5) / 3, (row + 0.5) / 3  # x, y as fractions


def _mask(shape: str, cx: float, cy: float, r: float, n: int) -> np.ndarray:
    """Coverage of the shape on an n x n grid (supersampled, then averaged)."""
    s = n * SUPERSAMPLE
    y, x = (np.mgrid[0:s, 0:s] + 0.5) / s
    if shape == "circle":
        inside = (x - cx) ** 2 + (y - cy) ** 2 <= r**2
    elif shape == "square":
        inside = (np.abs(x - cx) <= r * 0.89) & (np.abs(y - cy) <= r * 0.89)
    elif shape == "diamond":  # (a square on its corner, inside the frame at a corner)
        inside = np.abs(x - cx) + np.abs(y - cy) <= r * 1.05
    else:  # an upward triangle
        top, bottom = cy - r, cy + r * 0.8
        half = (y - top) / (bottom - top) * r * 1.1
        inside = (y >= top) & (y <= bottom) & (np.abs(x - cx) <= half)
    return inside.reshape(n, SUPERSAMPLE, n, SUPERSAMPLE).mean(axis=(1, 3))


def render_at(
    shape: str, colour: str, background: str, cx: float, cy: float, r: float, n: int
) -> np.ndarray:
    cover = _mask(shape, cx, cy, r, n)[..., None]
    fg = np.array(PAINTS[colour], np.float32)
    bg = np.array(PAINTS[background], np.float32)
    return (bg * (1 - cover) + fg * cover).round().astype(np.uint8)


def render(scene: Scene, n: int = 64) -> np.ndarray:
    cx, cy = _centre(scene.position)
    return render_at(scene.shape, scene.colour, scene.background, cx, cy, SIZES[scene.size], n)


def sample_clip(rng: random.Random) -> Clip:
    colour, background = rng.sample(list(COLOURS), 2)
    return Clip(rng.choice(SHAPES), colour, background, rng.choice(DIRECTIONS))


def render_clip(clip: Clip, frames: int = 9, n: int = 64) -> np.ndarray:
    """The shape crosses the frame in the asked direction (from 0.2 to 0.8 of the side)."""
    out = []
    for i in range(frames):
        t = 0.2 + 0.6 * i / max(1, frames - 1)
        cx, cy = {"right": (t, 0.5), "left": (1 - t, 0.5), "down": (0.5, t), "up": (0.5, 1 - t)}[
            clip.direction
        ]
        out.append(render_at(clip.shape, clip.colour, clip.background, cx, cy, 0.16, n))
    return np.stack(out)
