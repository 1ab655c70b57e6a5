"""Typed options of each stage kind (a YAML stage's `options:`, the catalog's model facts).

Validated when the StageConfig is built: a misspelt or unknown option, or a value of the wrong
type, is an error naming the stage and the option, never silently ignored. A stage class of a
user's own (`kind: module:Class`) gets its options as the dict it was given.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, get_type_hints

from vllm_omni_like.errors import ConfigError


@dataclass(frozen=True)
class DiffusionOptions:
    """What the catalog knows of a diffusion model (its defaults and built-in limits); the
    stage flags `--max-side` etc. override the limits."""

    default_steps: int | None = None  # None: models/limits.py's default
    default_guidance: float | None = None  # None: the model family's (`Family.default_guidance`)
    default_size: int | None = None  # None: the model's native size
    default_width: int | None = None
    default_height: int | None = None
    default_frames: int | None = None
    default_fps: int | None = None
    max_side: int | None = None
    max_pixels: int | None = None
    max_frames: int | None = None
    max_steps: int | None = None
    max_sequence_length: int = 512  # text tokens a T5-style encoder is given
    compile_backend: str = "inductor"
    batch_buckets: tuple[int, ...] = ()


@dataclass(frozen=True)
class LLMOptions:
    prompt_template: str = "{prompt}"
    max_new_tokens: int = 24
    # a rewriter trained to answer this alone for a prompt outside its model's world: the
    # request fails with 400 `prompt_outside_model_domain` and `outside_message`
    outside_answer: str | None = None
    outside_message: str = ""
    # a Lark grammar that keeps every row without a constraint of its own inside the language
    # the model was trained to write (tiny-llm: the caption language, shapes/world.py)
    output_grammar: str | None = None


@dataclass(frozen=True)
class NullOptions:
    """The torch-free stage of control-plane tests."""

    output: str = "image"  # image | video | text
    steps: int = 4
    decode_delay: float = 0.0  # seconds the deferred rest of a batch takes
    # seconds per step per million units of the batch's work (cost.py): a step that takes
    # longer the more pixels, frames and images it runs, as a GPU's does
    step_s_per_munit: float = 0.0
    max_side: int | None = None


OPTIONS_BY_KIND: dict[str, type] = {
    "diffusion": DiffusionOptions,
    "llm": LLMOptions,
    "null": NullOptions,
}
NULL_OUTPUTS = ("image", "video", "text")


def _coerce(stage: str, name: str, hint: Any, value: Any) -> Any:
    text = str(hint)
    if value is None:
        if "None" in text:
            return None
        raise ConfigError(f"stage {stage!r}: option {name} must not be empty")
    try:
        if text.startswith("tuple"):
            values = value if isinstance(value, list | tuple) else str(value).split(",")
            return tuple(int(v) for v in values)
        if "bool" in text:
            raise TypeError
        for kind in (int, float, str):
            if kind.__name__ in text:
                if kind is int and isinstance(value, float) and not value.is_integer():
                    raise ValueError
                if kind is not str and isinstance(value, bool):
                    raise TypeError
                return kind(value)
    except (TypeError, ValueError):
        pass
    named = text.replace(" | None", "").replace("<class '", "").replace("'>", "")
    raise ConfigError(f"stage {stage!r}: option {name}={value!r} is not a valid {named}")


def parse_options(kind: str, stage: str, given: Any) -> Any:
    """The typed options of a stage of `kind` from what was given (a dict, or typed already)."""
    cls = OPTIONS_BY_KIND.get(kind)
    if cls is None:  # a user's own stage class: it types them itself (Stage.options_type)
        return given
    return typed(cls, stage, given)


def typed(cls: type, stage: str, given: Any) -> Any:
    """`given` (a mapping, or `cls` already) as `cls`, every key known and every value valid."""
    if isinstance(given, cls):
        return given
    if not isinstance(given, dict):
        raise ConfigError(f"stage {stage!r}: options must be a mapping")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ConfigError(
            f"stage {stage!r}: unknown option{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(unknown)} for a {cls.__name__.removesuffix('Options').lower()} stage; "
            f"known: {', '.join(sorted(known))}"
        )
    hints = get_type_hints(cls)
    values = {name: _coerce(stage, name, hints[name], v) for name, v in given.items()}
    options = cls(**values)
    if isinstance(options, NullOptions) and options.output not in NULL_OUTPUTS:
        raise ConfigError(
            f"stage {stage!r}: option output must be one of {', '.join(NULL_OUTPUTS)}"
        )
    return options
