"""A LoRA file to the low-rank weights of each denoiser layer it adapts, checked against the
base model before any of it reaches the device.

Read: safetensors only (a pickle file - .ckpt, .pt, .bin - is refused unread: reading one runs
code). Converted: by the pipeline's own diffusers converter (`lora_state_dict` of its LoRA
loader mixin: kohya-style files of SD1.5 and SDXL - `lora_unet_*`, `lora_down`/`lora_up`,
`alpha` - and FLUX.1's kohya, xlabs and BFL forms), then diffusers'
`convert_unet_state_dict_to_peft` (its older `lora.down`/`lora.up` names): every module ends
as peft's `lora_A` / `lora_B`.
Supported: the denoiser's attention and MLP linear layers (`Adapter.lora_layers`); refused by
name: a text encoder's keys, a LoCon convolution (a 4-D `lora_A`), DoRA, a LoRA bias, a module
the base lacks, a linear layer outside attention and MLPs, a rank over the pool's. The scale of
a module is peft's: alpha / rank (alpha from the file's alphas, else its peft metadata's
`lora_alpha` and `alpha_pattern`, else the rank: scale 1; `use_rslora`: alpha / sqrt(rank));
it is folded into B here.

A model of two experts (Wan2.2-A14B: `transformer`, `transformer_2`) takes diffusers' Wan files:
their `transformer.` keys go into both experts (as diffusers' `load_lora_weights` of the file,
then again with `load_into_transformer_2=True`), unless the file also has `transformer_2.` keys:
then each prefix's keys go into its own expert (one file for both, Lightning's two halves merged).
Its modules are then named by expert (`transformer_2.blocks.0.attn1.to_q`).

An adapter may carry the steps and guidance it was distilled for in its safetensors metadata
(`default_steps`, `default_guidance_scale`); a registration's (`loras:` in YAML) win.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni_like.loras import PICKLE_SUFFIXES, SUFFIX, LoraSpec, pickle_refusal
from vllm_omni_like.stages.diffusion.lora_layers import Target

ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3", "te")
META_STEPS, META_GUIDANCE = "default_steps", "default_guidance_scale"


class LoraError(ValueError):
    """An adapter that cannot be used: its message names the adapter and why."""


@dataclass(frozen=True)
class AdapterWeights:
    """An adapter read and checked: each target module's A (rank, in) and B (out, rank) with
    its scale folded in, float32 on the host; the steps and guidance it was made for."""

    name: str
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]
    rank: int
    steps: int | None
    guidance: float | None


def read_adapter(
    spec: LoraSpec,
    pipe_class: type,
    experts: tuple[str, ...],
    targets: dict[str, Target],
    known: set[str],
    max_rank: int,
) -> AdapterWeights:
    """`spec`'s file as weights for the denoisers `experts` (unet, transformer; two: Wan2.2's),
    whose LoRA layers are `targets` and modules `known` (two experts: named `expert.module`);
    LoraError where it cannot be used."""
    raw, meta = _load(spec)
    layers = {}
    for expert, prefix in _experts_of(spec.name, raw, experts):
        denoiser, alphas, peft_meta = _convert(spec.name, raw, pipe_class, (prefix, experts), meta)
        named = "" if len(experts) == 1 else expert + "."
        for module, (a, b) in sorted(_modules(spec.name, denoiser).items()):
            _check_module(spec.name, named + module, a, b, targets, known, max_rank)
            scale = _alpha(module, a.shape[0], alphas, peft_meta) / a.shape[0]
            if peft_meta.get("use_rslora"):
                scale = scale * math.sqrt(a.shape[0])  # alpha / sqrt(rank)
            layers[named + module] = (a.float(), b.float() * scale)
    if not layers:
        raise LoraError(f"LoRA {spec.name!r}: its file adapts none of the denoiser's layers")
    steps, guidance = _defaults(spec, meta)
    rank = max(a.shape[0] for a, _ in layers.values())
    return AdapterWeights(spec.name, layers, rank, steps, guidance)


def _experts_of(
    name: str, raw: dict[str, torch.Tensor], experts: tuple[str, ...]
) -> list[tuple[str, str]]:
    """(expert, the file's key prefix it takes): the first expert's prefix into every expert,
    unless the file names the others' too (see the module's docstring)."""
    if len(experts) == 1:
        return [(experts[0], experts[0])]
    named = [e for e in experts[1:] if any(k.startswith(e + ".") for k in raw)]
    if not named:
        return [(e, experts[0]) for e in experts]
    return [(e, e) for e in experts if e == experts[0] or e in named]


def _load(spec: LoraSpec) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The file's tensors and metadata (a pickle refused unread; a broken file named)."""
    import safetensors
    import safetensors.torch

    base = os.path.basename(spec.path)
    if spec.path.lower().endswith(PICKLE_SUFFIXES):
        raise LoraError(f"LoRA {spec.name!r}: {pickle_refusal(spec.path)}")
    if not spec.path.endswith(SUFFIX):
        raise LoraError(f"LoRA {spec.name!r}: {base} is not a {SUFFIX} file")
    try:  # (read whole, not mapped: a file replaced while its tensors are read would fault
        with open(spec.path, "rb") as f:  # the worker with SIGBUS, under a mapping's pages)
            data = f.read()
        tensors = safetensors.torch.load(data)
        meta = _metadata(data)
    except (OSError, ValueError, RuntimeError, safetensors.SafetensorError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise LoraError(
            f"LoRA {spec.name!r}: {base} cannot be read as safetensors: {first}"
        ) from None
    return tensors, meta


def _metadata(data: bytes) -> dict[str, str]:
    """A safetensors file's `__metadata__` (its header: an 8-byte little-endian length, then
    JSON), read from the bytes `safetensors.torch.load` has accepted."""
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    return {str(k): str(v) for k, v in (header.get("__metadata__") or {}).items()}


def _convert(
    name: str,
    raw: dict[str, torch.Tensor],
    pipe_class: type,
    where: tuple[str, tuple[str, ...]],
    meta: dict[str, str],
) -> tuple[dict[str, torch.Tensor], dict[str, float], dict[str, Any]]:
    """The keys of prefix `where[0]` in peft form (diffusers' converters), the alphas by module
    and the peft metadata of that denoiser; a text encoder's keys, or keys of no denoiser of
    the model (`where[1]`), refused."""
    prefix, experts = where
    from diffusers.utils import convert_unet_state_dict_to_peft

    convert = getattr(pipe_class, "lora_state_dict", None)
    if convert is None:
        raise LoraError(f"LoRA {name!r}: {pipe_class.__name__} has no diffusers LoRA loader")
    kwargs: dict[str, Any] = {"return_lora_metadata": True}
    if "return_alphas" in inspect.signature(convert).parameters:
        kwargs["return_alphas"] = True
    try:  # (state, alphas, metadata), or (state, metadata) where a family has no alphas
        out = convert(dict(raw), **kwargs)
        state, alphas = out[0], out[1] if len(out) == 3 else None
    except (ValueError, KeyError, IndexError, RuntimeError) as exc:
        raise LoraError(f"LoRA {name!r}: diffusers' converter refused it: {exc}") from None
    encoders = sorted({k.split(".")[0] for k in state if k.split(".")[0] in ENCODERS})
    if encoders:
        raise LoraError(
            f"LoRA {name!r}: text-encoder LoRA keys are not supported ({', '.join(encoders)}): "
            "only the denoiser's attention and MLP layers"
        )
    own = {k: v for k, v in state.items() if k.startswith(prefix + ".")}
    if len(own) < len(state):  # (keys of another expert are read with it)
        stray = sorted(k for k in set(state) - set(own) if k.split(".")[0] not in experts)
        if stray:
            raise LoraError(f"LoRA {name!r}: key {stray[0]!r} is not of the {prefix}")
    denoiser = convert_unet_state_dict_to_peft({k[len(prefix) + 1 :]: v for k, v in own.items()})
    by_module = {}
    for key, value in (alphas or {}).items():
        key = key.removeprefix(prefix + ".")
        peft_key = next(iter(convert_unet_state_dict_to_peft({key: value})))
        by_module[peft_key.split(".lora")[0].removesuffix(".alpha")] = float(value)
    peft_meta = {}
    if meta.get("lora_adapter_metadata"):
        full = json.loads(meta["lora_adapter_metadata"])
        peft_meta = {k[len(prefix) + 1 :]: v for k, v in full.items() if k.startswith(prefix + ".")}
    return denoiser, by_module, peft_meta


def _modules(name: str, state: dict[str, torch.Tensor]) -> dict[str, tuple[Any, Any]]:
    """module -> (lora_A, lora_B) weights; DoRA, biases and other keys refused by name."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        match = re.fullmatch(r"(.+)\.lora_([AB])\.weight", key)
        if match is None:
            what = "DoRA" if "magnitude" in key or "dora" in key else "an unsupported kind"
            raise LoraError(f"LoRA {name!r}: key {key!r} is {what} (plain LoRA only)")
        pairs.setdefault(match[1], {})[match[2]] = value
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise LoraError(f"LoRA {name!r}: {module} has lora_A or lora_B without the other")
    return {m: (p["A"], p["B"]) for m, p in pairs.items()}


def _check_module(
    name: str,
    module: str,
    a: torch.Tensor,
    b: torch.Tensor,
    targets: dict[str, Target],
    known: set[str],
    max_rank: int,
) -> None:
    if a.dim() != 2 or b.dim() != 2:
        raise LoraError(
            f"LoRA {name!r}: {module} is a convolution (LoCon): not supported; "
            "only attention and MLP linear layers"
        )
    if module not in known:
        raise LoraError(f"LoRA {name!r}: the base model has no module {module}")
    target = targets.get(module)
    if target is None:
        raise LoraError(
            f"LoRA {name!r}: {module} is not an attention or MLP linear layer: not supported"
        )
    if a.shape[0] > max_rank:
        raise LoraError(
            f"LoRA {name!r}: rank {a.shape[0]} of {module} is over --max-lora-rank {max_rank}"
        )
    want = (target.in_features, target.out_features)
    if (a.shape[1], b.shape[0]) != want or b.shape[1] != a.shape[0]:
        raise LoraError(
            f"LoRA {name!r}: {module} is {a.shape[1]} -> {b.shape[0]} but the base layer "
            f"is {want[0]} -> {want[1]} (an adapter of another model?)"
        )


def _alpha(module: str, rank: int, alphas: dict[str, float], meta: dict[str, Any]) -> float:
    """A module's alpha as diffusers' peft config gives it (see the module's docstring)."""
    if module in alphas:
        return alphas[module]
    for pattern, value in (meta.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?({pattern})", module):
            return float(value)
    if alphas:  # (kohya: every module its own alpha; none given is its rank)
        return float(rank)
    return float(meta.get("lora_alpha", rank))


def _defaults(spec: LoraSpec, meta: dict[str, str]) -> tuple[int | None, float | None]:
    """The steps and guidance an adapter is made for: its registration's, else its file's."""
    try:
        steps = int(meta[META_STEPS]) if META_STEPS in meta else None
        guidance = float(meta[META_GUIDANCE]) if META_GUIDANCE in meta else None
    except ValueError:
        raise LoraError(
            f"LoRA {spec.name!r}: metadata {META_STEPS} / {META_GUIDANCE} must be numbers"
        ) from None
    if steps is not None and steps < 1:
        raise LoraError(f"LoRA {spec.name!r}: metadata {META_STEPS} must be >= 1")
    return (
        spec.steps if spec.steps is not None else steps,
        spec.guidance if spec.guidance is not None else guidance,
    )
