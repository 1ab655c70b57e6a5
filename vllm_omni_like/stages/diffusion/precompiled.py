"""Precompiled forwards: a warm start or a restart loads each compiled shape's forward from the
compile cache without tracing it.

With `--compile-cache` alone, a start finds inductor's compiled graphs in the cache but dynamo
still traces every compiled shape (the cache is keyed by the traced graph): most of a warm
start. Here each compiled denoiser (or, compiled regionally, each of its blocks) runs through
`Precompiled`: the first forward of an input signature (names, shapes, strides, dtypes, devices:
one compiled bucket) is compiled ahead of time (`torch.compile(fullgraph=True).aot_compile`,
experimental in torch 2.9 to 2.13), its artifact - the graph's guards, the bytecode that calls
it, inductor's compiled code - saved under `<cache>/precompiled/`; a later process loads it and
runs it after its guards pass on the live module, with no trace. A forward that cannot be
compiled so (a graph break, a backend whose output is not serializable) runs dynamo's own
compile as before, with one warning a module class.

An artifact is found only by a key made of everything it was made under: torch's and Python's
versions, the device's name, the stage's compile choices (`salt`), the module's structure (each
submodule's class, each parameter's and buffer's name, shape, stride and dtype, each plain
attribute's value), the input signature and this format's version; and it is used only where
the source of every function its trace inlined is still what it was (a checksum of each module's
source) and its guards pass. Anything else - missing, stale, unreadable - is a warning and a
compile, whose artifact replaces it.

Guards that cannot be serialized (an object's identity, a global's) are dropped from the
artifact, as torch's own precompile does: the key stands for them. So a stage whose forwards
read process state through such guards does not precompile: LoRA adapters (the rows' context),
ranks that hand each forward to others (config: `Precompile.wanted`).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
import os
import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_omni_like.config import StageConfig

logger = logging.getLogger("vllm_omni_like.stages.diffusion.stage")

FORMAT = 1  # this module's artifacts' layout: a change makes every earlier one a miss
UNSERIALIZABLE = (  # guard kinds an artifact cannot hold (torch's own list, and its precompile's)
    "DICT_VERSION",
    "NN_MODULE",
    "ID_MATCH",
    "FUNCTION_MATCH",
    "CLASS_MATCH",
    "MODULE_MATCH",
    "CLOSURE_MATCH",
    "WEAKREF_ALIVE",
)


def call_module(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What an artifact traces: the module's call (its hooks included), the module an input."""
    return model(*args, **kwargs)


def keep_guard(entries: Sequence[Any]) -> list[bool]:
    """The guards an artifact keeps: all but globals' and those it cannot serialize."""
    return [
        not (g.is_global or g.guard_type in UNSERIALIZABLE)
        and not any(d in UNSERIALIZABLE for d in g.derived_guard_types)
        for g in entries
    ]


@dataclass
class Counts:
    """What a process's precompiled forwards did (its start report)."""

    loaded: int = 0  # artifacts loaded: forwards that run without a trace
    saved: int = 0  # compiled ahead of time and saved
    fallbacks: int = 0  # forwards not precompiled into the cache (a warning says why)
    warned: set[str] = field(default_factory=set)


COUNTS = Counts()
# artifacts by path, each read once a process: every block of a kind shares its kind's (an
# artifact holds no module - the module is an input -, and its guards run on each block's call)
LOADED: dict[str, Any] = {}


def available() -> bool:
    """Whether this torch can precompile: it loads compiled functions and its compiled ones
    have `aot_compile`. torch 2.11 (the H100 machine's) gives them `aot_compile` only while
    `torch._dynamo.config.enable_aot_compile` is on, off by default there (on in 2.13): this
    turns it on first (`Precompiled._compile` again, where it wraps: the flag is read as
    `torch.compile` wraps a function)."""
    switch_on_aot_compile()
    if not hasattr(torch.compiler, "load_compiled_function"):
        return False
    return hasattr(torch.compile(call_module), "aot_compile")  # (wraps only: compiles nothing)


def switch_on_aot_compile() -> None:
    """torch 2.11's `torch._dynamo.config.enable_aot_compile` on (it gates the API only)."""
    import torch._dynamo.config as dynamo_config

    if getattr(dynamo_config, "enable_aot_compile", True) is False:
        dynamo_config.enable_aot_compile = True


class Precompiled:
    """An `OptimizedModule`'s forward: per input signature, its artifact loaded from
    `directory`, else compiled ahead of time and saved there, else dynamo's own forward."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimized: Any,
        directory: str,
        salt: str,
        options: dict[str, Any],
        stage: str,
    ) -> None:
        self.model = model  # (what torch.compile wrapped in `optimized`)
        self.dynamo = optimized.forward  # (dynamo's compile of the module: the fallback)
        self.directory = os.path.join(directory, "precompiled")
        self.options = options  # torch.compile's backend and mode
        self.stage = stage
        self.prefix = "|".join([_system(), salt, structure(self.model), str(FORMAT)])
        self.fns: dict[str, Any] = {}  # by input signature; None: dynamo's

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = signature(args, kwargs)
        if key not in self.fns:
            self.fns[key] = self._load(key, args, kwargs) or self._compile(key, args, kwargs)
        fn = self.fns[key]
        if fn is None or not fn.guard_check(self.model, args, kwargs):
            return self.dynamo(*args, **kwargs)
        return fn(self.model, args, kwargs)

    def path(self, key: str) -> str:
        digest = hashlib.sha256(f"{self.prefix}|{key}".encode()).hexdigest()[:32]
        return os.path.join(self.directory, f"{type(self.model).__name__}-{digest}.bin")

    def _load(self, key: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        path = self.path(key)
        if path in LOADED:
            return LOADED[path]
        if not os.path.exists(path):
            return None
        try:
            with open(path, "rb") as f:
                fn: Any = torch.compiler.load_compiled_function(f)
            if (changed := stale_source(fn)) is not None:
                raise RuntimeError(f"the source of {changed} changed since it was compiled")
            if not fn.guard_check(self.model, args, kwargs):
                raise RuntimeError("its guards fail on this module")
        except Exception as exc:
            self._warn(f"the precompiled forward {os.path.basename(path)} is not usable ({exc})")
            return None
        fn.disable_guard_check()  # (checked before each call: a failed check runs dynamo's)
        COUNTS.loaded += 1
        LOADED[path] = fn
        return fn

    def _compile(self, key: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        options = {**self.options, "guard_filter_fn": keep_guard}
        backend = options.pop("backend")
        switch_on_aot_compile()
        try:
            compiled: Any = torch.compile(
                call_module, backend=backend, fullgraph=True, dynamic=False, options=options
            )
            fn = compiled.aot_compile(((self.model, args, kwargs), {}))
        except Exception as exc:
            self._cannot(exc)
            return None
        fn.disable_guard_check()
        path = self.path(key)  # (no module in it: an input); written whole, then renamed:
        temporary = f"{path}.{os.getpid()}.tmp"  # replicas share the directory
        try:
            os.makedirs(self.directory, exist_ok=True)
            fn.save_compiled_function(temporary)
            os.replace(temporary, path)
        except Exception as exc:  # (this process runs it; the next one compiles it again)
            self._cannot(exc)
            with contextlib.suppress(OSError):
                os.remove(temporary)
            return fn
        COUNTS.saved += 1
        LOADED[path] = fn
        return fn

    def _cannot(self, exc: Exception) -> None:
        """One warning a module class: its forward is traced at each start."""
        COUNTS.fallbacks += 1
        name = type(self.model).__name__
        if name not in COUNTS.warned:
            COUNTS.warned.add(name)
            first = str(exc).splitlines()[0] if str(exc) else ""
            self._warn(
                f"{name}'s forward cannot be precompiled ({type(exc).__name__}: {first}); "
                "it is traced at each start"
            )

    def _warn(self, message: str) -> None:
        logger.warning("stage %s: %s", self.stage, message)


@dataclass(frozen=True)
class Precompile:
    """Where a stage's precompiled forwards live and what they were made under."""

    directory: str  # the compile cache
    salt: str  # the stage's compile choices
    stage: str

    def install(self, model: torch.nn.Module, optimized: Any, backend: str, mode: str) -> None:
        """Run `optimized` (torch.compile's module of `model`) through its precompiled
        forwards."""
        options: dict[str, Any] = {"backend": backend}
        if backend == "inductor" and mode != "default":
            import torch._inductor

            options |= torch._inductor.list_mode_options(mode)
        optimized.forward = Precompiled(
            model, optimized, self.directory, self.salt, options, self.stage
        )


def for_stage(config: StageConfig, backend: str) -> Precompile | None:
    """A stage's precompiled forwards, in its compile cache: for a stage with one, on a replica
    of one rank without LoRA adapters (their rows' context would hide behind guards an artifact
    cannot keep)."""
    if not config.compile_cache:
        return None
    if not available():
        logger.info(
            "stage %s: torch %s cannot precompile forwards (no aot_compile): they are traced "
            "at each start, their compiled graphs read from the compile cache",
            config.name,
            torch.__version__,
        )
        return None
    if config.leads or config.loras or config.lora_dir is not None:
        return None
    choices = (config.dtype, config.quantization, config.attention, config.channels_last)
    salt = repr((*choices, config.compile_mode, config.regional, backend))
    return Precompile(os.path.abspath(config.compile_cache), salt, config.name)


def signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """A forward's inputs as one compiled shape sees them (tensors' layouts, other values)."""
    parts: list[str] = [f"grad={torch.is_grad_enabled()}"]
    _describe(args, "args", parts)
    _describe(kwargs, "kwargs", parts)
    return ";".join(parts)


def _describe(value: Any, name: str, out: list[str]) -> None:
    if isinstance(value, torch.Tensor):
        out.append(
            f"{name}:{value.dtype}{tuple(value.shape)}{value.stride()}{value.device.type}"
            f"{value.requires_grad}"
        )
    elif isinstance(value, (list, tuple)):
        out.append(f"{name}:{type(value).__name__}{len(value)}")
        for i, v in enumerate(value):
            _describe(v, f"{name}.{i}", out)
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            _describe(value[k], f"{name}.{k}", out)
    else:
        out.append(f"{name}={type(value).__name__}:{value!r}")


def structure(model: torch.nn.Module) -> str:
    """A digest of what a module's trace depends on besides its inputs' values: each submodule's
    class and plain attributes, each parameter's and buffer's layout."""
    h = hashlib.sha256()
    for name, module in model.named_modules():
        cls = type(module)
        h.update(f"{name}:{cls.__module__}.{cls.__qualname__};".encode())
        for attr, value in sorted(vars(module).items()):
            if attr.startswith("_") or isinstance(value, torch.Tensor):
                continue
            h.update(f"{attr}={_plain(value)};".encode())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        h.update(f"{name}:{t.dtype}{tuple(t.shape)}{t.stride()}{t.device.type};".encode())
    return h.hexdigest()


def _plain(value: Any) -> str:
    """An attribute's value where it is plain data, else its class (an attention processor)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, (tuple, list)) and all(
        isinstance(v, (bool, int, float, str)) for v in value
    ):
        return repr(value)
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _system() -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return f"torch {torch.__version__} python {platform.python_version()} {device}"


def stale_source(fn: Any) -> str | None:
    """The first module whose source changed since `fn`'s trace inlined it (None: none)."""
    for source in fn.source_info().inlined_sources:
        module = sys.modules.get(source.module)
        try:
            if module is None:
                return str(source.module)
            if hasattr(source, "content"):  # (torch 2.13: the module's whole source)
                if inspect.getsource(module) != source.content:
                    return str(source.module)
                continue
            # (earlier: the checksum of the inlined function's lines)
            from torch._dynamo.package import _hash_sourcelines

            now = _hash_sourcelines(module, source.firstlineno, source.lastlineno)
        except (OSError, TypeError, ImportError):
            return str(source.module)
        if now != source.checksum:
            return str(source.module)
    return None
