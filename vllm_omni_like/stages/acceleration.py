"""Speed options of a diffusion stage: attention kernels, channels_last, torch.compile.

None of them changes the maths: the same weights, scheduler, steps and guidance as plain
diffusers; only which kernels run and how batches are shaped.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

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
    if backend == "sdpa":  # diffusers' default processors call scaled_dot_product_attention
        return "sdpa"
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


# ---- kernels that keep the maths ------------------------------------------------------
def tune_kernels(pipe: Any, device: torch.device, fuse_qkv: bool, compiled: bool) -> list[str]:
    """Fused QKV projections, and cuDNN's autotuned convolutions for a compiled model, on CUDA.

    Returns what is on. The fused projections use diffusers' SDPA processors, so they are left
    out under xformers. Autotuning is kept for the compiled setting, where it was measured
    (H200); in eager mode it gained nothing at batch 32 and cost 13% at batch 1 (29.2 against
    25.7 ms per UNet forward), so eager keeps cuDNN's heuristics like plain diffusers.
    """
    if device.type != "cuda":
        return []
    done = []
    if compiled:
        torch.backends.cudnn.benchmark = True  # the fastest conv algorithm per shape, found once
        done.append("cudnn_benchmark")
    unet = getattr(pipe, "unet", None)
    if fuse_qkv and unet is not None and hasattr(pipe, "fuse_qkv_projections"):
        pipe.fuse_qkv_projections()  # one GEMM instead of three for each self-attention
        done.append("fused_qkv")
    return done


# ---- memory format -------------------------------------------------------------------
def use_channels_last(pipe: Any, mode: str, device: torch.device, compiled: bool) -> bool:
    """NHWC for the conv nets (UNet, image VAE; NDHWC for Wan's video VAE) where the tensor
    cores prefer it.

    `auto` turns it on for a compiled UNet on CUDA and for a video VAE on CUDA. In eager mode
    the layout copies around each normalisation of a UNet or image VAE cost more than the
    convolutions gain (H200, batch 32 with CFG: UNet forward 220 ms NHWC against 185 ms NCHW,
    VAE decode 516 against 359 ms), while compiled, where Inductor plans the layouts, NHWC is
    the faster one (130 against 133 ms). Wan's 3-D VAE decodes a 832x480 video of 33 frames in
    0.675 s with NDHWC weights against 0.744 s (H200; 0.768 against 0.845 s on an H100; at most
    6 of 255 levels apart in bf16, another choice of cuDNN kernels; `bench/vae_decode.py`).
    """
    unet, vae = getattr(pipe, "unet", None), getattr(pipe, "vae", None)
    cuda = device.type == "cuda"
    if mode == "off" or (mode == "auto" and not cuda):
        return False
    done = False
    if mode == "on" or (unet is not None and compiled):
        if unet is not None:
            unet.to(memory_format=torch.channels_last)
            done = True
        if _image_vae(vae):
            vae.to(memory_format=torch.channels_last)
            done = True
    if type(vae).__name__ == "AutoencoderKLWan":
        for module in vae.modules():  # (its 1-D weights refuse `vae.to(memory_format=...)`)
            if isinstance(module, torch.nn.Conv3d):
                module.weight.data = module.weight.data.contiguous(
                    memory_format=torch.channels_last_3d
                )
        done = True
    return done


def _image_vae(vae: Any) -> bool:
    return type(vae).__name__ == "AutoencoderKL"  # Wan's video VAE is 3-D


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
def denoiser_name(pipe: Any) -> str:
    return "unet" if getattr(pipe, "unet", None) is not None else "transformer"


def compile_denoiser(pipe: Any, mode: str, backend: str) -> list[str]:
    """Compile the denoiser in place, and the image VAE's decoder; returns what was compiled.

    Shapes are static: batches are padded to buckets. The decoder is one call per batch, but
    compiled it decodes 32 images at 512x512 in 202 ms instead of 359 ms on an H200.
    """
    import torch._dynamo

    # every (size, bucket) pair is one graph; let all of them stay compiled
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    kwargs: dict[str, Any] = {"backend": backend, "dynamic": False}
    if backend == "inductor" and mode != "default":
        kwargs["mode"] = mode
    name = denoiser_name(pipe)
    setattr(pipe, name, torch.compile(getattr(pipe, name), **kwargs))
    done = [name]
    vae = getattr(pipe, "vae", None)
    if _image_vae(vae):
        vae.decoder = torch.compile(vae.decoder, **kwargs)
        done.append("vae.decoder")
    return done


def buckets_for(max_rows: int, configured: Any = None) -> tuple[int, ...]:
    """Batch sizes (images per model call, before CFG doubling) to compile and pad up to."""
    if configured:
        return tuple(sorted({int(b) for b in configured}))
    found = tuple(b for b in DEFAULT_BUCKETS if b < max_rows)
    return (*found, max_rows)


def bucket_for(rows: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket that holds `rows`; past the largest, `rows` itself."""
    return next((b for b in buckets if b >= rows), rows)


# ---- classifier-free guidance in one forward ----------------------------------------------
def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape


class DenoiserWrapper(torch.nn.Module):
    """A denoiser in the pipeline's place: what it does not define comes from the model (config,
    cache_context, ...), and its `dtype` is read once (a diffusers model's walks its modules at
    every read, and the pipeline reads it at every call)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.model_dtype: torch.dtype | None = getattr(model, "dtype", None)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype if self.model_dtype is None else self.model_dtype

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.model, name)


class BatchedCFG(DenoiserWrapper):
    """Runs a pipeline's two guidance calls of the denoiser (conditional, then unconditional,
    on the same latents) as one forward over both halves.

    diffusers' Wan pipeline calls its transformer twice a step; the UNet pipelines already
    batch the two. `arm(kwargs)` before a call (the negative prompt embeddings in the
    denoiser's dtype, the very tensor passed to the pipeline), `disarm()` after: a conditional
    call then computes both halves and the unconditional call that follows with the same
    latents gets its half without running the model. Any other call runs as it is.
    """

    needs_embeddings = True  # the stage encodes the prompts before the call, for `arm`

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.negative: torch.Tensor | None = None
        self._pending: tuple[torch.Tensor, tuple] | None = None

    def arm(self, kwargs: dict[str, Any]) -> None:
        self.negative = kwargs["negative_prompt_embeds"]

    def settle(self) -> None:
        """After a call: raise if a branch computed elsewhere failed (CFG-parallel); none here."""

    def disarm(self) -> None:
        self.negative = None
        self._pending = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        pending, self._pending = self._pending, None
        latents = kwargs.get("hidden_states")
        text = kwargs.get("encoder_hidden_states")
        negative = self.negative
        if (
            negative is None
            or args
            or latents is None
            or text is None
            or kwargs.get("return_dict", True)
        ):
            return self.model(*args, **kwargs)
        if _same(text, negative):
            if pending is not None and _same(latents, pending[0]):
                return pending[1]  # computed with the conditional half
            return self.model(**kwargs)
        if text.shape != negative.shape:
            return self.model(**kwargs)
        cond, uncond = self._branches(kwargs, negative)
        self._pending = (latents, uncond)
        return cond

    def _branches(self, kwargs: dict[str, Any], negative: torch.Tensor) -> tuple[tuple, tuple]:
        """The conditional call's outputs and the unconditional one's: here, one forward."""
        latents, text = kwargs["hidden_states"], kwargs["encoder_hidden_states"]
        timestep = kwargs.get("timestep")
        both = dict(
            kwargs,
            hidden_states=torch.cat([latents, latents]),
            encoder_hidden_states=torch.cat([text, negative]),
        )
        if isinstance(timestep, torch.Tensor) and timestep.dim() > 0:
            both["timestep"] = torch.cat([timestep, timestep])
        out = self.model(**both)
        rows = latents.shape[0]
        rest = tuple(out[1:])
        return (out[0][:rows], *rest), (out[0][rows:], *rest)


def batch_cfg(pipe: Any) -> BatchedCFG | None:
    """Wrap the denoiser of a pipeline that runs guidance as two calls (Wan); else None."""
    if type(pipe).__name__ != "WanPipeline" or getattr(pipe, "transformer_2", None) is not None:
        return None
    wrapper = BatchedCFG(pipe.transformer)
    pipe.transformer = wrapper
    return wrapper
