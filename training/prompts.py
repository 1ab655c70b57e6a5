"""What people type to the rewriter, generated: the training pairs (prompt -> caption).

Each pair names some of a scene's attributes in one of many phrasings and the target is the
caption of what gets drawn (`world.scene_from_named`: the named attributes, defaults for the
rest), or `OUTSIDE` for a prompt that names nothing the world can draw. The variation is the
model's to learn: synonyms of the world's words, word order, lists, several sentences, filler
before and after, casing, punctuation and spacing, whole captions (kept as they are), and
made-up words (never meaning anything: a made-up word where a colour would stand leaves the
colour unnamed). The held-out prompts (heldout/omni_prompts.jsonl) were written separately and
are never read here.
"""

from __future__ import annotations

import random

from outside_words import OTHER_ADJECTIVES, OTHER_FRAMES, OTHER_NOUNS
from prompt_words import (
    BACKGROUND_AFTER,
    BACKGROUND_BEFORE,
    BACKGROUND_SENTENCE,
    BARE_POSITION,
    COLOUR_SENTENCE,
    FILLER_AFTER,
    FILLER_BEFORE,
    NO_SHAPE,
    POSITION_PHRASES,
    POSITION_PREFIX,
    POSITION_SENTENCE,
    PUNCT,
    SHAPE_SENTENCE,
    SIZE_SENTENCE,
    SIZE_WORDS,
)

from vllm_omni_like.shapes import world

OUTSIDE = world.OUTSIDE

CONSONANTS, VOWELS = "bcdfghjklmnprstvwxz", "aeiou"


def made_up_word(rng: random.Random) -> str:
    """A word in no vocabulary: it must be read as meaning nothing the world draws."""
    known = set(world.COLOURS) | set(world.SHAPES) | {w for ws in SIZE_WORDS.values() for w in ws}
    while True:
        word = "".join(
            rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(rng.randint(2, 3))
        ) + rng.choice(["", "n", "l", "r", "sh", "x", "ish", "y"])
        if word not in known:
            return word


def _named(rng: random.Random) -> dict[str, str]:
    scene = world.sample_scene(rng, held_out=None)
    odds = {"shape": 0.8, "colour": 0.85, "size": 0.35, "position": 0.5, "background": 0.5}
    named = {k: getattr(scene, k) for k, p in odds.items() if rng.random() < p}
    if rng.random() < 0.08:  # the defaults' exception: a white or black shape, no background
        named["colour"] = rng.choice([world.DEFAULT_COLOUR, world.DEFAULT_BACKGROUND])
        named.pop("background", None)
    if not named:
        named = {"colour": scene.colour}
    return named


def _position(rng: random.Random, pos: str) -> str:
    if pos in BARE_POSITION and rng.random() < 0.25:
        return rng.choice(BARE_POSITION[pos])
    return f"{rng.choice(POSITION_PREFIX)} {rng.choice(POSITION_PHRASES[pos])}"


def _noun_phrase(rng: random.Random, named: dict[str, str], unknown: dict[str, str]) -> str:
    words = []
    if "size" in named:
        size = rng.choice(SIZE_WORDS[named["size"]])
        words.append(f"({size})" if rng.random() < 0.05 else size)
    colour = named.get("colour") or unknown.get("colour")
    if colour:
        words.append(colour)
    shape = named.get("shape") or unknown.get("shape") or rng.choice(NO_SHAPE)
    if colour and rng.random() < 0.15:  # "a circle that is red", "a circle in red"
        tail = rng.choice(
            [f"that is {colour}", f"in {colour}", f"coloured {colour}", f", {colour}"]
        )
        words = [w for w in words if w != colour] + [shape, tail]
    elif colour and rng.random() < 0.08:  # "red-triangle"
        words[-1] = f"{colour}-{shape}"
    else:
        words.append(shape)
    article = rng.choice(["a", "a", "an" if words[0][0] in "aeiou" else "a", "one", "the", ""])
    return " ".join(w for w in [article, *words] if w)


def _background_colour(named: dict[str, str], unknown: dict[str, str]) -> str | None:
    return named.get("background") or unknown.get("background")


def _phrase(rng: random.Random, named: dict[str, str], unknown: dict[str, str]) -> str:
    """One noun phrase with its place and background, in some order."""
    parts = [_noun_phrase(rng, named, unknown)]
    tails = []
    if "position" in named:
        tails.append(_position(rng, named["position"]))
    bg = _background_colour(named, unknown)
    if bg and rng.random() < 0.2:
        parts.insert(0, rng.choice(BACKGROUND_BEFORE).format(c=bg))
    elif bg:
        tails.append(rng.choice(BACKGROUND_AFTER).format(c=bg))
    rng.shuffle(tails)
    if tails and rng.random() < 0.1:  # "(top left)"
        i = rng.randrange(len(tails))
        tails[i] = rng.choice(["({})", "[{}]", "- {} -", "{{{}}}"]).format(tails[i])
    if tails and rng.random() < 0.2:  # the place first: "at the top, a red circle"
        lead = tails.pop(0)
        parts.insert(0, lead + rng.choice([",", "", ":", " -"]))
    sep = rng.choice([" ", " ", " ", ", ", "; ", " - ", " / ", ",", ";", "/"])
    return sep.join([" ".join(parts), *tails]) if tails else " ".join(parts)


def _listing(rng: random.Random, named: dict[str, str], unknown: dict[str, str]) -> str:
    items = []
    for key in ("shape", "colour", "size", "position", "background"):
        value = named.get(key) or unknown.get(key)
        if value is None:
            continue
        if key == "size":
            value = rng.choice(SIZE_WORDS[value])
        elif key == "position":
            value = rng.choice(POSITION_PHRASES[named["position"]])
        elif key == "background":
            value = rng.choice(
                ["on {c}", "{c} background", "{c} bg", "bg {c}", "background {c}"]
            ).format(c=value)
        if rng.random() < 0.2 and key != "background":
            value = f"{key.replace('colour', rng.choice(['colour', 'color']))}: {value}"
        items.append(value)
    rng.shuffle(items)
    return rng.choice([", ", "; ", " / ", " - ", ". ", " | ", ",", ";", "/"]).join(items)


def _sentences(rng: random.Random, named: dict[str, str], unknown: dict[str, str]) -> str:
    shape = named.get("shape") or unknown.get("shape") or rng.choice(NO_SHAPE)
    out = [rng.choice(SHAPE_SENTENCE).format(s=shape, S=shape.capitalize())]
    colour = named.get("colour") or unknown.get("colour")
    if colour:
        out.append(rng.choice(COLOUR_SENTENCE).format(c=colour, C=colour.capitalize(), s=shape))
    if "size" in named:
        z = rng.choice(SIZE_WORDS[named["size"]])
        out.append(rng.choice(SIZE_SENTENCE).format(z=z, Z=z.capitalize()))
    if "position" in named:
        q = rng.choice(POSITION_PHRASES[named["position"]])
        p = _position(rng, named["position"])
        out.append(rng.choice(POSITION_SENTENCE).format(p=p, P=p.capitalize(), q=q))
    bg = _background_colour(named, unknown)
    if bg:
        out.append(rng.choice(BACKGROUND_SENTENCE).format(c=bg, C=bg.capitalize()))
    first, rest = out[:1], out[1:]
    rng.shuffle(rest)
    if rng.random() < 0.3:  # the background or place first
        return " ".join(rest + first)
    return " ".join(first + rest)


def _outside(rng: random.Random) -> str:
    if rng.random() < 0.5:
        frame = rng.choice(OTHER_FRAMES)
        return frame.format(
            n=rng.choice(OTHER_NOUNS), m=rng.choice(OTHER_NOUNS), a=rng.choice(OTHER_ADJECTIVES)
        )
    words = [made_up_word(rng) for _ in range(rng.randint(1, 4))]
    glue = rng.choice(
        [
            "a {0}",
            "the {0}",
            "{0}",
            "a {0} of a {1}",
            "an image of {0}",
            "{0} with {1}",
            "a {0} {1} on a {1} background",
            "{0} at the {1}",
            "picture of a {0}",
            "hello",
            "hi there friend",
            "just {0}",
            "{0}?",
            "what is a {0}",
            "a {0} {1}",
            "draw a {0}",
            "my {0} and the {1}",
            "so, {0} {1}",
        ]
    )
    return glue.format(*words, *words)


def _case(rng: random.Random, text: str) -> str:
    r = rng.random()
    if r < 0.55:
        return text
    if r < 0.68:
        return text.upper()
    if r < 0.8:
        return text.title()
    if r < 0.88:
        return text.capitalize()
    return "".join(c.upper() if rng.random() < 0.4 else c for c in text)


def _noise(rng: random.Random, text: str) -> str:
    if rng.random() < 0.15:
        text = text.replace(" ", rng.choice(["  ", "   ", " \t "]))
    if rng.random() < 0.1:
        q = rng.choice(['"', "'", "(", "*"])
        text = q + text + {"(": ")"}.get(q, q)
    return text.strip() + rng.choice(PUNCT)


def sample_pair(rng: random.Random) -> tuple[str, str]:
    """One (prompt, target caption or OUTSIDE)."""
    if rng.random() < 0.1:
        return _noise(rng, _case(rng, _outside(rng))), OUTSIDE
    named = _named(rng)
    target = world.scene_from_named(named).caption()
    if rng.random() < 0.12:  # a whole caption, kept as it is
        return _noise(rng, _case(rng, target)), target
    unknown: dict[str, str] = {}
    for key in ("colour", "shape", "background"):
        if key not in named and rng.random() < 0.15:
            unknown[key] = made_up_word(rng)
    style = rng.random()
    if style < 0.08:  # the phrase inside a sentence
        frame = rng.choice(
            [
                "there is {} here",
                "{} is what i want",
                "picture {}",
                "imagine {}",
                "all i want is {}",
                "{}, that is the plan",
                "an image with {}",
                "a picture featuring {}",
                "a render of {}",
                "a graphic containing {}",
                "artwork: {}",
            ]
        )
        text = frame.format(_phrase(rng, named, unknown))
    elif style < 0.55:
        text = _phrase(rng, named, unknown)
    elif style < 0.75:
        text = _listing(rng, named, unknown)
    else:
        text = _sentences(rng, named, unknown)
    if rng.random() < 0.45:
        text = f"{rng.choice(FILLER_BEFORE)} {text}"
    if rng.random() < 0.3:
        text = f"{text}{rng.choice([',', '', ' -', '.'])} {rng.choice(FILLER_AFTER)}"
    if rng.random() < 0.1:
        text = f"{text} {made_up_word(rng)}"
    return _noise(rng, _case(rng, text)), target


def pairs(n: int, seed: int) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    rows = [sample_pair(rng) for _ in range(n)]
    return [p for p, _ in rows], [t for _, t in rows]
