"""FP8 attention (`--attention fp8`): its maths, written once in torch (`emulate`, the CPU's
implementation and the reference of the tests), the custom op the denoisers call, the start-up
check, and the routing of diffusers' attention processors to it.

The maths, SageAttention's recipe (forward only, no dropout, no mask but a key-padding one),
over (B, S, H, D) tensors in bf16:
- Q times the softmax scale and log2(e) (the softmax runs in base 2), quantized to e4m3 per
  block of BLOCK_M queries of a head: one float32 scale a block, its largest magnitude / 448.
- K minus its mean over the sequence (per batch, head and channel) - which shifts every score
  of a query by the same amount and so leaves its softmax as it was, while taking out the
  channel-wise offset that real keys carry and that would otherwise set the blocks' scales -
  then quantized per block of BLOCK_N keys the same way.
- V quantized with one scale per channel (per batch and head) over the whole sequence.
- A key a key-padding mask leaves out: its K and V zeroed first (no scale of theirs), its
  scores -inf.
- Scores S = (Q8 K8^T) q_scale k_scale in float32; flash attention's online softmax over the
  key blocks: P = exp2(S - running max) in [0, 1], times 448 and cast to e4m3 (a static
  scale), O += P8 V8 in float32, the row sums taken from P before its cast; at the end
  O * v_scale / 448 / row sum (a query whose keys are all left out: 0, as SDPA gives).
The kernel (fp8_attention_kernel.py) computes exactly this, block for block; only the order of
its float32 sums differs.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from vllm_omni_like.errors import ConfigError
from vllm_omni_like.stages.diffusion.fp8 import sqnr_db

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest value
MIN_AMAX = 1e-12  # a block of zeros gets a tiny scale, not a division by zero
LOG2E = math.log2(math.e)
BLOCK_M = 128  # queries a block (a Q scale each)
BLOCK_N = 64  # keys a block (a K scale each; the online softmax's step)
HEAD_DIMS = (64, 128)
MIN_CAPABILITY = (8, 9)  # Ada and Hopper: the first CUDA devices with FP8 tensor cores
FLAG = "--attention fp8"
# the start-up check's bound on the kernel against the emulation (the GPU tests' too; the
# interpreter measures 47.8 dB: the order of float32 sums, then bf16's rounding)
MIN_AGREEMENT_DB = 40.0


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """`x` (float32) rounded onto e4m3's grid (to nearest even, saturated at 448), as float32."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8).float()


def key_mean(k: torch.Tensor) -> torch.Tensor:
    """K's mean over the sequence, (B, H, D) float32, from (B, S, H, D) (summed in float32
    without a float32 copy of K: one pass over it on the GPU)."""
    return k.mean(dim=1, dtype=torch.float32)


def value_scales(v: torch.Tensor) -> torch.Tensor:
    """V's per-channel scales, (B, H, D) float32, from (B, S, H, D) (the largest magnitude as
    an infinity norm: no copy of |V|)."""
    amax = torch.linalg.vector_norm(v, ord=math.inf, dim=1, dtype=torch.float32)
    return amax.clamp(min=MIN_AMAX) / FP8_MAX


def blockwise(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, S, D) float32 -> (its values on e4m3's grid, each token's block scale
    (B, H, S, 1)): one scale a block of `block` tokens, its largest magnitude / 448."""
    seq = x.shape[2]
    blocks = F.pad(x, (0, 0, 0, -seq % block)).unflatten(2, (-1, block))
    scale = blocks.abs().amax(dim=(-2, -1), keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    values = e4m3(blocks / scale).flatten(2, 3)[:, :, :seq]
    return values, scale.expand(*scale.shape[:3], block, 1).flatten(2, 3)[:, :, :seq]


def padded_out(
    k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V with the keys `keep` (B, S) leaves out zeroed (none: as they are), so that a
    padded key's values set no scale; their scores are then left out of the softmax."""
    if keep is None:
        return k, v
    kept = keep[:, :, None, None]
    return k.masked_fill(~kept, 0), v.masked_fill(~kept, 0)


def emulate(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel's maths in torch, block for block, for (B, S, H, D) tensors (`keep`: the
    keys attended, (B, S) bool; none: all); the output like `q` (its dtype, contiguous)."""
    dtype = q.dtype
    k, v = padded_out(k, v, keep)
    mean, v_scale = key_mean(k)[:, :, None], value_scales(v)[:, :, None]
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))  # (B, H, S, D)
    q8, q_scale = blockwise(q * (scale * LOG2E), BLOCK_M)
    k8, k_scale = blockwise(k - mean, BLOCK_N)
    v8 = e4m3(v / v_scale)
    row_max = torch.full(q.shape[:3], -math.inf, device=q.device)
    row_sum = torch.zeros(q.shape[:3], device=q.device)
    acc = torch.zeros(q.shape, device=q.device)
    for start in range(0, k.shape[2], BLOCK_N):
        keys = slice(start, start + BLOCK_N)
        scores = (q8 @ k8[:, :, keys].mT) * (q_scale * k_scale[:, :, keys].mT)
        if keep is not None:
            scores = scores.masked_fill(~keep[:, None, None, keys], -math.inf)
        new_max = torch.maximum(row_max, scores.amax(dim=-1))
        safe = new_max.nan_to_num(neginf=0.0)  # (no key yet: nothing to subtract)
        alpha = torch.exp2(row_max - safe)
        p = torch.exp2(scores - safe[..., None])
        row_sum = row_sum * alpha + p.sum(dim=-1)
        acc = acc * alpha[..., None] + e4m3(p * FP8_MAX) @ v8[:, :, keys]
        row_max = new_max
    # a query none of whose keys is kept has no sum (and no values): 0 out, as SDPA gives
    row_sum = torch.where(row_sum > 0, row_sum, 1.0)
    out = acc * (v_scale / FP8_MAX) / row_sum[..., None]
    return out.transpose(1, 2).to(dtype).contiguous()


# ---- the op the denoisers call ---------------------------------------------------------------
@torch.library.custom_op("vllm_omni_like::fp8_attention", mutates_args=())
def fp8_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v in FP8 for (B, S, H, D) tensors over the keys `keep` (B, S)
    marks (none: all): the Triton kernel on CUDA, its emulation elsewhere (the CPU tests').
    One opaque op to torch.compile: its graphs hold the call, never a break."""
    if q.device.type == "cuda":
        return run_kernel(q, k, v, scale, keep)
    return emulate(q, k, v, scale, keep)


@fp8_attention.register_fake
def _fp8_attention_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def run_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Triton kernel (imported here: Triton only where it runs) with this maths' blocks,
    scales and K's mean."""
    from vllm_omni_like.stages.diffusion.fp8_attention_kernel import fp8_attention_kernel

    k, v = padded_out(k, v, keep)
    stats = key_mean(k), value_scales(v)
    blocks = (BLOCK_M, BLOCK_N)
    return fp8_attention_kernel(q, k, v, scale * LOG2E, *stats, blocks, keep)


def takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the FP8 op runs this attention (B, S, H, D): bf16, a head size of HEAD_DIMS,
    as many heads in each (no grouped queries), keys and values alike."""
    same = q.dtype == k.dtype == v.dtype == torch.bfloat16 and k.shape == v.shape
    return same and q.shape[-1] in HEAD_DIMS and q.shape[::2] == k.shape[::2]


# ---- the start-up check ------------------------------------------------------------------------
def fp8_attention_problem(device: torch.device) -> str | None:
    """None when the FP8 attention kernel runs on `device`; otherwise why not. On a CUDA device
    of compute capability 8.9 or newer, a small attention is run and checked against the
    emulation, so a Triton that cannot build the kernel is found here, not in a request."""
    if device.type != "cuda":
        return f"{FLAG} runs on CUDA (compute capability 8.9 or newer), not on {device.type}"
    found = torch.cuda.get_device_capability(device)
    if found < MIN_CAPABILITY:
        return (
            f"{FLAG} needs CUDA compute capability 8.9 or newer (Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} is {found[0]}.{found[1]}"
        )
    try:
        agreement = kernel_agreement(device)
    except Exception as exc:  # no Triton, a Triton that cannot compile the kernel here
        first = str(exc).splitlines()[0] if str(exc) else ""
        return f"{FLAG}: the Triton kernel does not run here: {type(exc).__name__}: {first}"
    if not agreement > MIN_AGREEMENT_DB:
        return (
            f"{FLAG}: the Triton kernel's results differ from its emulation here "
            f"({agreement:.1f} dB SQNR, not above {MIN_AGREEMENT_DB:g})"
        )
    return None


def kernel_agreement(device: torch.device) -> float:
    """The SQNR (dB) of the op's output on `device` against the emulation's, the lower of two
    small attentions with a tail block: head size 64 unmasked, 128 with a key-padding mask
    (each a kernel Triton builds apart). The same maths: only float32 sums' order differs."""
    found = []
    for dim, masked in ((64, False), (128, True)):
        torch.manual_seed(0)
        q, k, v = torch.randn(3, 2, 200, 2, dim, device=device, dtype=torch.bfloat16)
        keep = (torch.arange(200, device=device) < 150).expand(2, 200) if masked else None
        got = fp8_attention(q, k, v, dim**-0.5, keep).float().flatten()
        want = emulate(q, k, v, dim**-0.5, keep).float().flatten()
        found.append(sqnr_db(want, got))
    return min(found)


def check_fp8_attention(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse `--attention fp8` where it cannot run (a start-up error naming the flag)."""
    problem = fp8_attention_problem(device)
    if problem is None and dtype != torch.bfloat16:
        problem = (
            f"{FLAG} runs bf16 activations (its kernel reads and writes bf16): use --dtype "
            f"bf16 or auto, not {str(dtype).removeprefix('torch.')}"
        )
    if problem is not None:
        raise ConfigError(problem)


# ---- routing diffusers' processors --------------------------------------------------------------
def key_padding(mask: torch.Tensor, key: torch.Tensor) -> torch.Tensor | None:
    """`mask` as the keys kept, (B, S), where it is a boolean key-padding mask (B, 1, 1, S):
    a padded text's (Qwen-Image's, Z-Image's); None where it is any other mask."""
    batch, seq = key.shape[:2]
    if mask.dtype == torch.bool and tuple(mask.shape) == (batch, 1, 1, seq):
        return mask.reshape(batch, seq)
    return None


def fp8_dispatch(original: Callable[..., Any]) -> Callable[..., Any]:
    """diffusers' `dispatch_attention_fn` with the calls FP8 attention takes (no mask but a
    key-padding one, no dropout, not causal, no backend or context-parallel setting of its
    own: `takes`) sent to the FP8 op; every other call to `original` (bf16 SDPA)."""

    def dispatch(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
        attention_kwargs: dict[str, Any] | None = None,
        *,
        backend: Any = None,
        parallel_config: Any = None,
    ) -> torch.Tensor:
        keep = None if attn_mask is None else key_padding(attn_mask, key)
        plain = dropout_p == 0.0 and not is_causal and not enable_gqa and not attention_kwargs
        own = backend is None and parallel_config is None
        if (attn_mask is None or keep is not None) and plain and own and takes(query, key, value):
            scale = query.shape[-1] ** -0.5 if scale is None else scale
            return torch.ops.vllm_omni_like.fp8_attention(query, key, value, scale, keep)
        return original(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
            attention_kwargs, backend=backend, parallel_config=parallel_config,
        )  # fmt: skip

    return dispatch


ROUTED: dict[type, type] = {}  # a processor class -> its FP8 twin (one class for torch.compile)


def routed_class(cls: type) -> type:
    """`cls` with its `__call__` run over globals whose `dispatch_attention_fn` is
    `fp8_dispatch`'s: the same code, the same signature, the attention sent to the FP8 op."""
    if cls not in ROUTED:
        call = cls.__call__
        names = {**call.__globals__}
        names["dispatch_attention_fn"] = fp8_dispatch(names["dispatch_attention_fn"])
        routed = types.FunctionType(
            call.__code__, names, call.__name__, call.__defaults__, call.__closure__
        )
        routed.__kwdefaults__ = call.__kwdefaults__
        routed.__doc__ = call.__doc__
        namespace = {"__call__": routed, "__module__": cls.__module__}
        twin = type(cls.__name__, (cls,), namespace)  # (diffusers reads processors' names)
        # another trace: a precompiled forward (precompiled.py) is keyed by its modules'
        # attributes' classes, the processors' among them, by qualified name
        twin.__qualname__ = f"{cls.__qualname__}[fp8 attention]"
        ROUTED[cls] = twin
    return ROUTED[cls]


def route_fp8_attention(model: torch.nn.Module) -> int:
    """Send the attention of `model`'s processors that call diffusers' `dispatch_attention_fn`
    (FLUX.1's, Qwen-Image's, Wan's, Z-Image's) to the FP8 op; returns how many. Processors that
    call SDPA themselves (SD3's, a sequence-parallel rank's, Z-Image's zeroed keys) stay bf16."""
    done = 0
    for module in model.modules():
        processor = getattr(module, "processor", None)
        owner = next((c for c in type(processor).__mro__ if "__call__" in vars(c)), object)
        code = getattr(vars(owner).get("__call__"), "__code__", None)
        if code is None or "dispatch_attention_fn" not in code.co_names:
            continue
        if type(processor) not in ROUTED.values():
            processor.__class__ = routed_class(type(processor))
        done += 1
    return done
