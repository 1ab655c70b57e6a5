"""LoRA adapters by name: a stage's registered adapters (`--lora NAME=PATH`, `loras:` in YAML)
and the run-time ones of `--lora-dir`, resolved to files that never leave their directory.

Torch-free: the API checks a request's names here, the worker finds their files here
(stages/diffusion/lora_files.py reads them). A name is letters, digits, `_`, `-` and `.`
(not leading), at most 64 characters: no separator, so `--lora-dir`'s `NAME.safetensors` is
a file of that directory and nothing else (its real path is checked too: a link out of the
directory is refused).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from vllm_omni_like.errors import ConfigError

SUFFIX = ".safetensors"  # the only format read: pickle formats (.ckpt, .pt, .bin) run code
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin", ".pkl")
# adapters one request (one row) may combine, by default (`--max-loras-per-request`): each
# row's update is gathered this many times a layer (stages/diffusion/lora_layers.py), so the
# batch's shapes never depend on the mix (a row with fewer reads slot 0 for the rest)
PER_REQUEST = 4
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class LoraSpec:
    """One registered adapter: its file, and the steps and guidance it is made for (a
    distilled "lightning" adapter: each of its rows runs them unless the request says)."""

    name: str
    path: str
    steps: int | None = None
    guidance: float | None = None


def check_name(name: str) -> str | None:
    """Why `name` is no adapter name (None: it is one)."""
    if not isinstance(name, str) or not NAME.fullmatch(name) or ".." in name:
        return (
            f"LoRA name {name!r} must be 1-64 letters, digits, '_', '-' or '.' (not first, no '..')"
        )
    return None


def _spec(stage: str, name: Any, value: Any) -> LoraSpec:
    """One `loras:` entry: NAME: PATH, or NAME: {path, steps, guidance}."""
    if (why := check_name(str(name))) is not None:
        raise ConfigError(f"stage {stage!r}: {why}")
    fields = value if isinstance(value, dict) else {"path": value}
    unknown = sorted(set(fields) - {"path", "steps", "guidance"})
    if unknown or not isinstance(fields.get("path"), str) or not fields["path"]:
        raise ConfigError(
            f"stage {stage!r}: LoRA {name!r} takes a path (and steps, guidance), not {value!r}"
        )
    steps, guidance = fields.get("steps"), fields.get("guidance")
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        raise ConfigError(f"stage {stage!r}: LoRA {name!r}: steps must be an integer >= 1")
    if guidance is not None and (not isinstance(guidance, int | float) or guidance < 0):
        raise ConfigError(f"stage {stage!r}: LoRA {name!r}: guidance must be a number >= 0")
    return LoraSpec(str(name), fields["path"], steps, None if guidance is None else float(guidance))


def parse_loras(stage: str, given: Any) -> tuple[LoraSpec, ...]:
    """A stage's registered adapters from what was given: specs, "NAME=PATH" strings (the
    flag, repeatable) or a YAML mapping; a name given twice is refused."""
    if isinstance(given, dict):
        specs = [_spec(stage, k, v) for k, v in given.items()]
    elif isinstance(given, list | tuple):
        specs = []
        for item in given:
            if isinstance(item, LoraSpec):
                specs.append(item)
                continue
            name, sep, path = str(item).partition("=")
            if not sep:
                raise ConfigError(f"stage {stage!r}: --lora takes NAME=PATH, not {item!r}")
            specs.append(_spec(stage, name.strip(), path.strip()))
    else:
        raise ConfigError(f"stage {stage!r}: loras must be a mapping NAME: PATH, not {given!r}")
    names = [s.name for s in specs]
    if twice := sorted({n for n in names if names.count(n) > 1}):
        raise ConfigError(f"stage {stage!r}: LoRA {', '.join(twice)} registered twice")
    for s in specs:
        if s.path.lower().endswith(PICKLE_SUFFIXES):
            raise ConfigError(f"stage {stage!r}: LoRA {s.name!r}: {pickle_refusal(s.path)}")
    return tuple(specs)


def pickle_refusal(path: str) -> str:
    return (
        f"{os.path.basename(path)} is a pickle file (it could run code when read): only "
        f"safetensors LoRA files are read; convert it to {SUFFIX}"
    )


def in_directory(directory: str, name: str) -> str | None:
    """`directory`'s file of adapter `name` (NAME.safetensors), None where it is not there, is
    not a regular file or its real path leaves the directory."""
    if check_name(name) is not None:
        return None
    root = os.path.realpath(directory)
    path = os.path.realpath(os.path.join(root, name + SUFFIX))
    if os.path.dirname(path) != root or not os.path.isfile(path):
        return None
    return path


def resolve(name: str, specs: tuple[LoraSpec, ...], directory: str | None) -> LoraSpec | None:
    """The adapter `name` (registered first, then `directory`'s), or None: unknown."""
    for spec in specs:
        if spec.name == name:
            return spec
    if directory is None or (path := in_directory(directory, name)) is None:
        return None
    return LoraSpec(name, path)


def served(specs: tuple[LoraSpec, ...], directory: str | None) -> list[str]:
    """Every adapter name a stage answers to now (the registered, then the directory's)."""
    names = [s.name for s in specs]
    if directory is not None and os.path.isdir(directory):
        for entry in sorted(os.listdir(directory)):
            stem = entry.removesuffix(SUFFIX)
            if entry.endswith(SUFFIX) and stem not in names and in_directory(directory, stem):
                names.append(stem)
    return names


def check_loras(
    stage: str,
    kind: str,
    given: Any,
    directory: str | None,
    max_loras: int,
    max_rank: int,
    per_request: int = PER_REQUEST,
) -> tuple[LoraSpec, ...]:
    """A stage's registered adapters, checked against where they run and its pool's size."""
    specs = parse_loras(stage, given)
    where = f"stage {stage!r}: LoRA adapters"
    if max_loras < 1 or max_rank < 1 or per_request < 1:
        raise ConfigError(
            f"{where}: max_loras, max_lora_rank and max_loras_per_request must be >= 1"
        )
    if directory is not None and not directory.strip():  # ("" would be the server's cwd)
        raise ConfigError(f"{where}: lora_dir is empty")
    if not specs and directory is None:
        return specs
    if kind != "diffusion" and ":" not in kind:  # (a stage class of one's own may take them)
        raise ConfigError(f"{where} run on a diffusion stage, not on a {kind!r} stage")
    if len(specs) > max_loras:
        raise ConfigError(f"{where}: {len(specs)} registered but max_loras is {max_loras}")
    return specs
