"""Device, dtype and model-building helpers shared by the torch stages."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import zlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from vllm_omni_like.errors import ConfigError


def _not_torchvision_fallback(record: logging.LogRecord) -> bool:
    # transformers falls back to its PIL image processors (which the edit pipelines' unused
    # feature extractors name) without torchvision, and says so once per class, per process
    return "requires torchvision (not installed)" not in record.getMessage()


def quiet_loading() -> None:
    """No progress bars and no torchvision fallback notices from the hub libraries in worker
    logs; their other warnings stay."""
    import diffusers
    import transformers

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    source = logging.getLogger("transformers.utils.import_utils")
    if _not_torchvision_fallback not in source.filters:
        source.addFilter(_not_torchvision_fallback)


_DTYPES = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as the flags name it: fp32, fp16, bf16 (another's torch name)."""
    return next((k for k, v in _DTYPES.items() if v == dtype), str(dtype).removeprefix("torch."))


def resolve_dtype(dtype: str, device: torch.device, gpu_default: torch.dtype) -> torch.dtype:
    if dtype == "auto":
        return gpu_default if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; use one of fp32, fp16, bf16")
    return _DTYPES[dtype]


def check_model_dir(path: str, marker: str) -> None:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist")
    if not os.path.exists(os.path.join(path, marker)):
        raise FileNotFoundError(f"{path!r} has no {marker}: not a model directory of this kind")


def random_diffusers_components(
    path: str, device: torch.device, dtype: torch.dtype
) -> dict[str, Any]:
    """`--load-format dummy`: every model of a diffusers directory built from its config alone.

    Each is initialised from a seed of its own (the CRC-32 of its name) on `device`, so two
    processes that build the same directory get the same weights: a benchmark's reference
    and the server compute the same images. Each is built in `dtype` directly (FLUX.1's 12B
    transformer would take 48 GB in float32 first); what a module makes in float32 on its own
    (a positional table) is cast after.
    """
    import diffusers
    import transformers

    with open(os.path.join(path, "model_index.json")) as f:
        index = json.load(f)
    components: dict[str, Any] = {}
    for name, spec in index.items():
        if name.startswith("_") or not isinstance(spec, list) or spec[0] is None:
            continue
        library, cls_name = spec
        sub = os.path.join(path, name)
        torch.manual_seed(zlib.crc32(name.encode()))
        if (
            library == "diffusers"
            and hasattr(getattr(diffusers, cls_name), "from_config")
            and issubclass(getattr(diffusers, cls_name), diffusers.ModelMixin)
        ):
            cls = getattr(diffusers, cls_name)
            with torch.device(device), default_dtype(dtype):
                components[name] = cls.from_config(cls.load_config(sub)).to(dtype)
        elif library == "transformers" and issubclass(
            getattr(transformers, cls_name), transformers.PreTrainedModel
        ):
            cls = getattr(transformers, cls_name)
            config = transformers.AutoConfig.from_pretrained(sub, local_files_only=True)
            with torch.device(device), default_dtype(dtype):
                components[name] = cls(config).to(dtype)
    return components


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Floating tensors made meanwhile (a module's parameters) are `dtype`."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def tensor_to_uint8(media: torch.Tensor) -> np.ndarray:
    """[0, 1] (B, C, H, W) or (B, F, C, H, W) on the device -> channels-last uint8 on the host.

    The same float32 maths as diffusers' numpy path (x * 255, round), done on the device, so
    only the uint8 bytes cross to the host, in one copy.
    """
    return device_uint8(media).cpu().numpy()


def device_uint8(media: torch.Tensor) -> torch.Tensor:
    """`tensor_to_uint8`'s pixels, still on the device."""
    pixels = (media.float().clamp(0, 1) * 255).round().to(torch.uint8)
    return pixels.movedim(-3, -1).contiguous()


class BatchDimProbe:
    """A forward pre-hook that records the largest batch dimension the model itself saw."""

    def __init__(self) -> None:
        self.max_seen = 0

    def reset(self) -> None:
        self.max_seen = 0

    def __call__(self, module: Any, args: tuple, kwargs: dict) -> None:
        tensor = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(tensor, torch.Tensor) and tensor.dim() > 0:
            self.max_seen = max(self.max_seen, int(tensor.shape[0]))

    def attach(self, module: torch.nn.Module) -> None:
        module.register_forward_pre_hook(self, with_kwargs=True)


def dummy_pipeline(
    path: str, device: torch.device, dtype: torch.dtype, own: dict[str, Any] | None = None
) -> Any:
    """The pipeline of a diffusers directory with random models (`--load-format dummy`).

    Built by calling the pipeline class itself: `from_pretrained` would still look for weight
    files of the components a pipeline marks optional (Wan's transformer, for one). Schedulers
    and tokenizers load from their folders; config values of model_index.json are passed on;
    `own`: components the family loaded itself (by name).
    """
    import inspect

    import diffusers
    import transformers

    with open(os.path.join(path, "model_index.json")) as f:
        index = json.load(f)
    cls = getattr(diffusers, index["_class_name"])
    accepted = inspect.signature(cls.__init__).parameters
    models = random_diffusers_components(path, device, dtype)
    kwargs: dict[str, Any] = {}
    for name, spec in index.items():
        if name.startswith("_") or name not in accepted:
            continue
        if not isinstance(spec, list):  # a config value, e.g. requires_safety_checker
            kwargs[name] = spec
        elif spec[0] is None:
            kwargs[name] = None
        elif name in (own or {}):
            kwargs[name] = (own or {})[name]
        elif name in models:
            kwargs[name] = models[name]
        else:
            owner = diffusers if spec[0] == "diffusers" else transformers
            kwargs[name] = getattr(owner, spec[1]).from_pretrained(os.path.join(path, name))
    return cls(**kwargs)
