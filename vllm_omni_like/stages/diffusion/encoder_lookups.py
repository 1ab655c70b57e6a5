"""diffusers' per-call lookups around the text encoders, answered from the stage's load.

SDXL's, FLUX.1's and Wan's `encode_prompt` ask `get_module_execution_device(encoder)` before
each encoder's call (SD1.5's, SD3's, Qwen-Image's and Z-Image's do not): it walks every module
of the encoder twice (a group-offload hook, then an accelerate hook) to learn where the inputs
go - 1.25 ms a call for CLIP-L's 151 modules, 2.5 ms for OpenCLIP-bigG's 393, 3.5 ms for
T5-XXL's 464 on a loaded CPU (bench/README.md, "the join's host time"). The stage never
offloads a text encoder (`--offload idle-expert` moves the denoisers' experts itself,
offload.py): `pin` checks once at load that no encoder has an offload hook and registers each
with the stage's device, and the modules defining the pipeline's class get a lookup that
answers a registered encoder (or its compiled wrapper) from the registry. Any other module -
another pipeline's in the same process, a registered encoder that got a hook at its top since -
gets diffusers' own walk, so a plain diffusers pipeline beside the stage is answered as before.

The pipelines derived from `TextualInversionLoaderMixin` also tokenize every prompt once more
per encoder (`maybe_convert_prompt`) to expand multi-vector textual-inversion tokens (`<t>`
followed by `<t>_1`, ...); with no such pair in a tokenizer (the stage loads no textual
inversion) the prompt comes back as it went in, and the pinned pipeline returns it without the
tokenizer's pass.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch

TEXT_ENCODER_PREFIX = "text_encoder"  # diffusers' component names: text_encoder, _2, _3
HOOKS = ("_hf_hook", "_diffusers_hook")  # accelerate's offload hooks, diffusers' registry
LOOKUP = "get_module_execution_device"  # the name diffusers' pipeline modules import it by

# each pinned encoder -> the stage's device
_PINNED: weakref.WeakKeyDictionary[torch.nn.Module, torch.device] = weakref.WeakKeyDictionary()


def pinned_device(module: torch.nn.Module) -> torch.device:
    """diffusers' `get_module_execution_device`, answered from the registry for an encoder
    `pin` registered (a compiled encoder by its original module) that has no hook at its top
    (offloading puts one there), else diffusers' own."""
    original = getattr(module, "_orig_mod", module)
    device = _PINNED.get(original)
    if device is not None and not any(hook in original.__dict__ for hook in HOOKS):
        return device
    from diffusers.utils.torch_utils import get_module_execution_device

    return get_module_execution_device(module)


def text_encoders(pipe: Any) -> list[tuple[str, torch.nn.Module]]:
    """The pipeline's loaded text encoders, by component name."""
    found = []
    for name, part in pipe.components.items():
        if name.startswith(TEXT_ENCODER_PREFIX) and isinstance(part, torch.nn.Module):
            found.append((name, part))
    return found


def pin(pipe: Any, device: torch.device) -> list[str]:
    """Register the pipeline's text encoders with `device` (refused where one has an offload
    hook: its inputs' device is the hook's), give the modules of the pipeline's class the
    registry's lookup, and skip the textual-inversion pass where no tokenizer has a
    multi-vector token; returns the encoders' names."""
    encoders = text_encoders(pipe)
    for name, encoder in encoders:
        hooked = [
            f"{name}.{path}".rstrip(".")
            for path, module in encoder.named_modules()
            if any(hook in module.__dict__ for hook in HOOKS)
        ]
        if hooked:
            raise RuntimeError(
                f"{hooked[0]} has an offload hook: the stage answers a text encoder's "
                "execution device from its load and offloads none through hooks"
            )
    for _, encoder in encoders:
        _PINNED[encoder] = device
    if encoders:
        _patch_modules(type(pipe))
    if not any(_multi_vector(t) for t in _tokenizers(pipe)):
        pipe.maybe_convert_prompt = _unchanged
    return [name for name, _ in encoders]


def _patch_modules(cls: type) -> None:
    """Each module defining one of `cls`'s bases that calls diffusers' lookup (imports it by
    name) gets the registry's (`pinned_device`; unregistered modules still walk)."""
    for base in cls.__mro__:
        module = sys.modules.get(base.__module__)
        if getattr(module, LOOKUP, pinned_device) is not pinned_device:
            setattr(module, LOOKUP, pinned_device)


def _tokenizers(pipe: Any) -> list[Any]:
    return [t for n, t in pipe.components.items() if n.startswith("tokenizer") and t is not None]


def _multi_vector(tokenizer: Any) -> bool:
    """Whether `tokenizer` has a textual inversion's multi-vector token (`<t>` and `<t>_1`),
    the one thing `maybe_convert_prompt` expands."""
    added = getattr(tokenizer, "added_tokens_encoder", {})
    return any(f"{token}_1" in added for token in added)


def _unchanged(prompt: Any, tokenizer: Any) -> Any:
    """`maybe_convert_prompt` where no tokenizer has a multi-vector token: the prompt as is."""
    return prompt
