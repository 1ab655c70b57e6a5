"""`--quantization fp8` at a diffusion stage's load: the checks that refuse it where it cannot
run, the denoisers' linear layers turned FP8 one at a time (fp8.py), and what that left.

The layers a family keeps in the weights' dtype are its adapter's rule
(`Adapter.high_precision_layers`, written in models/<family>/adapter.py with the reason); so are
those whose sizes the FP8 kernels do not take (a side not a multiple of 16). Each layer's
weight is quantized where the model was loaded and its 16-bit copy dropped at once, so the
stage keeps no 16-bit copy of a quantized layer; the load itself peaks where a 16-bit stage's
does (the whole model as loaded, before the first layer is quantized).
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vllm_omni_like.config import StageConfig
from vllm_omni_like.errors import ConfigError
from vllm_omni_like.models.adapter import Adapter
from vllm_omni_like.stages.diffusion.fp8 import Fp8Linear, quantize_rows, sqnr_db
from vllm_omni_like.stages.torch_utils import dtype_name

logger = logging.getLogger("vllm_omni_like.stages.diffusion.stage")

TORCHAO_PIN = "0.18.0"  # pyproject.toml's `fp8` extra; the benchmark's reference runs it
MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first CUDA devices with FP8 tensor cores
FLAG = "--quantization fp8"
KERNEL_MULTIPLE = 16  # both sides of a weight the FP8 kernels take


@dataclass(frozen=True)
class Quantized:
    """What `--quantization fp8` did to one denoiser (the start-up log, the benchmark)."""

    name: str  # the pipeline's attribute: transformer, transformer_2
    fp8_layers: int
    kept_layers: int  # linear layers left in the weights' dtype (the family's rule, sizes)
    bytes_before: int  # the denoiser's parameters and buffers
    bytes_after: int

    def log_line(self) -> str:
        return (
            f"{self.name} {size(self.bytes_before)} -> {size(self.bytes_after)} "
            f"({self.fp8_layers} linear layers FP8, {self.kept_layers} kept)"
        )


def size(n: int) -> str:
    """Bytes as the log says them: GiB, or MiB below one GiB (the tiny models)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def fp8_problem(device: torch.device) -> str | None:
    """None when rowwise FP8 matmuls run on `device`; otherwise why not. A CUDA device needs
    compute capability 8.9; there and on the CPU a small product is run and checked, so a torch
    build without the kernels is found here, not in the first request."""
    if device.type == "cuda":
        found = torch.cuda.get_device_capability(device)
        if found < MIN_CAPABILITY:
            return (
                f"{FLAG} needs CUDA compute capability 8.9 or newer (Ada, Hopper); "
                f"{torch.cuda.get_device_name(device)} is {found[0]}.{found[1]}"
            )
    elif device.type != "cpu":
        return f"{FLAG} runs on CUDA and on the CPU, not on {device.type}"
    try:
        torch.manual_seed(0)
        linear = torch.nn.Linear(32, 16, dtype=_activations(device), device=device)
        x = torch.randn(4, 32, dtype=linear.weight.dtype, device=device)
        with torch.no_grad():
            got = sqnr_db(linear(x), Fp8Linear.from_linear(linear)(x))
    except RuntimeError as exc:  # a torch build without rowwise FP8 kernels for this device
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return f"{FLAG}: torch {torch.__version__}'s rowwise torch._scaled_mm fails here: {first}"
    if not got > 20:
        return f"{FLAG}: torch._scaled_mm's rowwise FP8 product is wrong here ({got:.1f} dB)"
    return None


def gpu_dtype(config: StageConfig) -> torch.dtype:
    """The weights' dtype `--dtype auto` picks on CUDA: bf16 with FP8 matmuls or attention
    (their kernels write bf16), fp16 otherwise."""
    fp8 = "fp8" in (config.quantization, config.attention)
    return torch.bfloat16 if fp8 else torch.float16


def _activations(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def check_fp8(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse `--quantization fp8` where it cannot run (a start-up error naming the flag)."""
    problem = fp8_problem(device)
    if problem is None and device.type == "cuda" and dtype != torch.bfloat16:
        problem = (
            f"{FLAG} on CUDA runs bf16 activations (the rowwise FP8 kernels write bf16): "
            f"use --dtype bf16 or auto, not {str(dtype).removeprefix('torch.')}"
        )
    if problem is not None:
        raise ConfigError(problem)


def torchao_state() -> str:
    """What the installed torchao is, for the start-up log: the server's FP8 path does not use
    it (fp8.py says why), so a torchao whose C++ kernels do not load for this torch is said,
    precisely, but refuses nothing."""
    try:
        version = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return (
            f"torchao not installed (the fp8 extra pins {TORCHAO_PIN}; the server does not use it)"
        )
    pin = "the pinned version" if version == TORCHAO_PIN else f"not the pinned {TORCHAO_PIN}"
    loaded, built = _torchao_kernels()
    kernels = f"{loaded} of {built} C++ kernel libraries loaded for torch {torch.__version__}"
    return f"torchao {version} ({pin}): {kernels} (unused by the server's FP8 path)"


def _torchao_kernels() -> tuple[int, int]:
    """(loaded, shipped) of torchao's C++ kernel libraries, once torchao is imported (it loads
    them where its build matches the installed torch, logging those that fail)."""
    import torchao  # noqa: F401  (its import loads the libraries)

    root = Path(str(importlib.metadata.distribution("torchao").locate_file("torchao")))
    shipped = sorted(str(p) for p in root.glob("_C*.so"))
    loaded = set(torch.ops.loaded_libraries)
    return sum(p in loaded for p in shipped), len(shipped)


def keeps(name: str, linear: torch.nn.Linear, rule: tuple[str, ...]) -> bool:
    """Whether the linear layer `name` keeps the weights' dtype: its family's rule, or sizes
    the FP8 kernels do not take."""
    sized = linear.in_features % KERNEL_MULTIPLE == 0 and linear.out_features % KERNEL_MULTIPLE == 0
    return not sized or any(fnmatch.fnmatchcase(name, p) for p in rule)


def quantize_model(model: torch.nn.Module, rule: tuple[str, ...]) -> tuple[int, int]:
    """Every linear layer of `model` that `rule` does not keep becomes an `Fp8Linear`, one at a
    time (its 16-bit weight dropped as its FP8 one is made); returns (FP8 layers, kept)."""
    linears = [(n, m) for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    done = kept = 0
    for name, linear in linears:
        if keeps(name, linear, rule):
            kept += 1
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, Fp8Linear.from_linear(linear))
        done += 1
    return done, kept


def model_bytes(model: torch.nn.Module) -> int:
    """The bytes of a model's parameters and buffers (its memory on the device)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def quantize_denoisers(adapter: Adapter, device: torch.device) -> list[Quantized]:
    """Each denoiser (both experts of a two-expert model) quantized by its family's rule."""
    rule = adapter.high_precision_layers()
    found = []
    for expert in adapter.experts():
        before = model_bytes(expert.model)
        done, kept = quantize_model(expert.model, rule)
        found.append(Quantized(expert.name, done, kept, before, model_bytes(expert.model)))
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the 16-bit weights' blocks back to the device
    return found


def weight_sqnr(model: torch.nn.Module, rule: tuple[str, ...]) -> dict[str, float]:
    """Per linear layer that `rule` would quantize: the SQNR (dB) of its FP8 weight against its
    own (the quantization of the weight alone, before any input)."""
    found = {}
    for name, m in model.named_modules():
        if type(m) is torch.nn.Linear and not keeps(name, m, rule):
            with torch.no_grad():
                values, scale = quantize_rows(m.weight)
                found[name] = sqnr_db(m.weight, values.float() * scale)
    return found


def describe(found: list[Quantized]) -> str:
    return "; ".join(q.log_line() for q in found)


def precision_of(quantization: str, dtype: torch.dtype, attention: str = "sdpa") -> str:
    """What `/health` says a stage runs: fp8, or its weights' dtype (bf16, fp16, fp32); then
    ", fp8 attention" where its attention runs FP8 (`--attention fp8`)."""
    matmuls = "fp8" if quantization == "fp8" else dtype_name(dtype)
    return f"{matmuls}, fp8 attention" if attention == "fp8" else matmuls


def hooks_sqnr(model: torch.nn.Module, rule: tuple[str, ...]) -> tuple[dict[str, float], Any]:
    """Forward hooks on each linear layer `rule` would quantize that record, at each call, its
    FP8 version's SQNR on the call's own input (the lowest over the calls); returns the
    record and a function that removes the hooks."""
    found: dict[str, float] = {}
    handles = []
    for name, m in model.named_modules():
        if type(m) is not torch.nn.Linear or keeps(name, m, rule):
            continue

        def hook(module: Any, args: tuple[Any, ...], out: torch.Tensor, name: str = name) -> None:
            with torch.no_grad():
                got = sqnr_db(out, Fp8Linear.from_linear(module)(args[0]))
            found[name] = min(got, found.get(name, got))

        handles.append(m.register_forward_hook(hook))

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return found, remove
