"""Speed options of a diffusion stage: attention kernels, channels_last, torch.compile.

None of them changes the maths: the same weights, scheduler, steps and guidance as plain
diffusers; only which kernels run and how batches are shaped.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vllm_omni_like.errors import ConfigError
from vllm_omni_like.models.adapter import Adapter, Guidance
from vllm_omni_like.stages.diffusion.fp8_attention import route_fp8_attention
from vllm_omni_like.stages.diffusion.precompiled import Precompile

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32)


# ---- attention ----------------------------------------------------------------------
def xformers_problem(device: torch.device) -> str | None:
    """None when xformers' kernels really run on `device`; otherwise why they do not.

    Importing is not enough: the PyPI wheel imports on torch builds it was not built for and
    then fails inside its kernels, so a tiny attention is actually run and checked here.
    """
    if device.type != "cuda":
        return f"xformers needs a CUDA device, this stage runs on {device.type}"
    try:
        import xformers.ops

        q = torch.randn(1, 64, 2, 64, device=device, dtype=torch.float16)
        out = xformers.ops.memory_efficient_attention(q, q, q)
        want = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2)
        ).transpose(1, 2)
        if not torch.allclose(out, want, atol=1e-2, rtol=1e-2):
            return "xformers' attention kernel gives wrong results here"
    except Exception as exc:  # ImportError, missing kernels, CUDA errors of a mismatched build
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".strip()
    return None


def set_attention(pipe: Any, backend: str, device: torch.device, stage: str) -> str:
    """Select the attention kernels; returns the backend that really runs."""
    if backend in ("sdpa", "fp8"):  # diffusers' default processors call SDPA (fp8: the load
        return backend  # checked the device; `fp8_attention` routes the processors once fused)
    problem = xformers_problem(device)
    if problem is None:
        try:
            pipe.enable_xformers_memory_efficient_attention()
            return "xformers"
        except Exception as exc:
            problem = f"{type(exc).__name__}: {exc}"
    logger.warning(
        "stage %s: --attention xformers is not usable (%s); falling back to PyTorch SDPA",
        stage,
        problem,
    )
    return "sdpa"


def fp8_attention(adapter: Adapter, stage: str) -> str:
    """`--attention fp8`: the denoisers' processors that call diffusers' attention function
    sent to the FP8 op (fp8_attention.py); what it did, for the start-up log. A denoiser with
    none of them is refused: the flag would change nothing."""
    routed = sum(route_fp8_attention(expert.model) for expert in adapter.experts())
    if routed == 0:
        raise ConfigError(
            f"stage {stage!r}: --attention fp8 found no attention of this model that calls "
            "diffusers' dispatch_attention_fn: serve it with --attention sdpa"
        )
    return (
        f"FP8 attention in {routed} attention modules (unmasked and key-padding-masked calls; "
        "other masks to SDPA)"
    )


# ---- kernels that keep the maths ------------------------------------------------------
def tune_kernels(
    adapter: Adapter, device: torch.device, attention: str, compiled: bool
) -> list[str]:
    """Fused QKV projections and faster attention kernels (where the family has them), and
    cuDNN's autotuned convolutions for a compiled model, on CUDA.

    Returns what is on. Both replace diffusers' SDPA processors (in place under `sdpa` and
    `fp8`), so they are left out under xformers; under `fp8` the family's faster attention is
    left out too (its processors call the kernels themselves: FP8 attention routes diffusers'
    own). Autotuning is kept for the compiled setting, where it
    was measured (H200); in eager mode it gained nothing at batch 32 and cost 13% at batch 1
    (29.2 against 25.7 ms per UNet forward), so eager keeps cuDNN's heuristics like plain
    diffusers.
    """
    if device.type != "cuda":
        return []
    done = []
    if compiled:
        torch.backends.cudnn.benchmark = True  # the fastest conv algorithm per shape, found once
        done.append("cudnn_benchmark")
    if attention != "xformers" and adapter.fuse_qkv():  # one GEMM, not three, a self-attention
        done.append("fused_qkv")
    if attention == "sdpa" and (fast := adapter.fast_attention()):
        done.append(fast)
    return done


# ---- memory format -------------------------------------------------------------------
def use_channels_last(adapter: Adapter, mode: str, device: torch.device, compiled: bool) -> bool:
    """Channels-last layouts where the family's adapter finds them faster (`auto`: on CUDA
    only; `on`: asked for; `off`: never)."""
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return False
    return adapter.channels_last(compiled, forced=mode == "on")


# ---- the pipeline's per-call lookups ----------------------------------------------------
def pin_execution_device(pipe: Any, device: torch.device) -> None:
    """Answer the pipeline's `_execution_device` with the stage's device.

    diffusers finds it on every call by walking every module of every model for offload hooks
    (~5,700 modules for Wan2.1-1.3B, twice a call): host time before the first forward, with
    the device idle (with the models' `dtype` lookups, ~30 ms of a 37-48 ms prelude on a 2-core
    CPU). A stage never offloads: its models stay on its device from load to close. The
    pipeline becomes an instance of a subclass of the same name (diffusers maps pipelines by
    class name) that says so."""
    cls = type(pipe)
    pinned = property(lambda self: device, doc="the stage's device (no offloading)")
    namespace = {"_execution_device": pinned, "__module__": cls.__module__}
    pipe.__class__ = type(cls.__name__, (cls,), namespace)


# ---- torch.compile ----------------------------------------------------------------------
def compile_models(
    adapter: Adapter,
    mode: str,
    backend: str,
    regional: bool = False,
    precompile: Precompile | None = None,
) -> list[str]:
    """Compile in place what the family's adapter names (its denoisers; a UNet pipeline's
    image VAE decoder too), each denoiser block by block where `regional`; returns what was
    compiled. Shapes are static: batches are padded to buckets. With `precompile`, the
    denoisers' compiled modules run their precompiled forwards (precompiled.py)."""
    kwargs = _compile_kwargs(mode, backend)
    names: dict[str, list[str]] = {}  # what was compiled, by where it is
    inside = {id(m) for e in adapter.experts() for m in e.model.modules()}  # the denoisers'
    for owner, name in regional_targets(adapter) if regional else adapter.compile_targets():
        module = getattr(owner, name)
        setattr(owner, name, compiled := torch.compile(module, **kwargs))
        if precompile is not None and id(module) in inside:
            precompile.install(module, compiled, backend, mode)
        names.setdefault(path_of(adapter.pipe, owner), []).append(name)
    return _spans(names)


def compile_text_encoders(adapter: Adapter, mode: str, backend: str) -> list[str]:
    """Compile in place the text encoders the family's adapter names (models/text_encoders.py:
    each called with one text at a fixed length, one graph an encoder; or, where the adapter
    says `text_encoders_by_block`, each encoder's repeated blocks, one graph a length shared by
    its blocks; not precompiled: their compiled code comes from the compile cache's FX graphs,
    dynamo traces them at each start); returns what was compiled."""
    kwargs = _compile_kwargs(mode, backend)
    names: dict[str, list[str]] = {}
    for owner, name in adapter.text_encoder_targets():
        encoder = getattr(owner, name)
        blocks = block_targets(encoder) if adapter.text_encoders_by_block else []
        for part, key in blocks or [(owner, name)]:
            setattr(part, key, torch.compile(getattr(part, key), **kwargs))
            names.setdefault(path_of(adapter.pipe, part), []).append(key)
    return _spans(names)


def _spans(names: dict[str, list[str]]) -> list[str]:
    """What was compiled, by where it is: a list's blocks once ("transformer.layers.0-29"),
    other attributes each by name."""
    found = []
    for where, got in names.items():
        if len(got) > 1 and all(n.isdigit() for n in got):
            got = [f"{got[0]}-{got[-1]}"]
        found += [f"{where}.{n}" if where else n for n in got]
    return found


def _compile_kwargs(mode: str, backend: str) -> dict[str, Any]:
    """torch.compile's arguments: static shapes (batches are padded to buckets)."""
    import torch._dynamo

    # every (size, bucket) pair is one graph; let all of them stay compiled
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    kwargs: dict[str, Any] = {"backend": backend, "dynamic": False}
    if backend == "inductor" and mode != "default":
        kwargs["mode"] = mode
    return kwargs


def regional_targets(adapter: Adapter) -> list[tuple[Any, str]]:
    """The adapter's compile targets with each whole denoiser replaced by its repeated blocks.
    Each block is compiled on its own, but torch.compile keeps one graph a class of block (the
    blocks share their code; their weights are the graph's inputs, not guarded by identity), so
    the warm-up compiles a block of each kind once a shape, not the whole denoiser; what lies
    between the blocks (embedders, the final layer) runs eager."""
    denoisers = {id(expert.model) for expert in adapter.experts()}
    found: list[tuple[Any, str]] = []
    for owner, name in adapter.compile_targets():
        module = getattr(owner, name)
        found += block_targets(module) if id(module) in denoisers else [(owner, name)]
    return found


def block_targets(model: torch.nn.Module) -> list[tuple[Any, str]]:
    """(list, index) of each entry of every `ModuleList` of `model` whose entries are blocks of
    one class (modules of modules: the transformer's blocks, however few), outermost lists
    only."""
    found: list[tuple[Any, str]] = []
    taken: list[str] = []  # the lists found: nothing inside them is taken again
    for path, module in model.named_modules():
        if any(path.startswith(f"{t}.") for t in taken):
            continue
        listed = list(module) if isinstance(module, torch.nn.ModuleList) else []
        kinds = {type(m) for m in listed}
        if len(kinds) == 1 and all(next(m.children(), None) is not None for m in listed):
            taken.append(path)
            found += [(module, str(i)) for i in range(len(module))]
    return found


def path_of(pipe: Any, owner: Any) -> str:
    """Where `owner` is in the pipeline: "" (the pipeline), a component's name, or a module's
    path inside one (`transformer.layers`)."""
    if owner is pipe:
        return ""
    for key, part in pipe.components.items():
        if part is owner:
            return str(key)
        if isinstance(part, torch.nn.Module):
            found = next((n for n, m in part.named_modules() if m is owner and n), None)
            if found is not None:
                return f"{key}.{found}"
    return type(owner).__name__


def buckets_for(max_rows: int, configured: Any = None) -> tuple[int, ...]:
    """Batch sizes (images per model call, before CFG doubling) to compile and pad up to."""
    if configured:
        return tuple(sorted({int(b) for b in configured}))
    found = tuple(b for b in DEFAULT_BUCKETS if b < max_rows)
    return (*found, max_rows)


def guided_rows(adapter: Adapter, batched_cfg: bool) -> int:
    """Model rows in one forward for an image with guidance: two where both branches share a
    forward, one where guidance is embedded (FLUX.1), absent, or its branches run apart."""
    if not batched_cfg or adapter.guidance in (Guidance.DISTILLED, Guidance.NONE):
        return 1
    return 2


def model_row_buckets(
    adapter: Adapter, buckets: tuple[int, ...], batched_cfg: bool = True
) -> tuple[int, ...]:
    """The model rows a compiled denoiser is warmed up for: each bucket of images once for rows
    without guidance (one model row an image: a Turbo row at guidance 0, an SD row at scale 1)
    and once for rows with it (two where both branches share a forward). A set that mixes them
    pads to the next of these: its rows still step in one forward."""
    per_row = guided_rows(adapter, batched_cfg)
    return tuple(sorted({*buckets, *(per_row * b for b in buckets)}))


def bucket_for(rows: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds `rows`; past the largest, `rows` itself."""
    return next((b for b in buckets if b >= rows), rows)


def log_recompiles() -> None:
    """From now on torch.compile logs each recompile and the guard that failed (the input that
    changed): after the warm-up, a recompile is a request paying for a compile."""
    import torch._logging

    torch._logging.set_logs(recompiles=True)
