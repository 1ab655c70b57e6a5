"""Z-Image's sequences padded to text buckets, so a compiled stage sees few shapes.

ZImageTransformer2DModel takes each row's caption at its own length (a list), pads it to a
multiple of 32 with its learned pad token (attended, as the model was trained), and pads the
batch to its longest row with a mask only where the rows' lengths differ: every new prompt
length is a new shape, and a compiled transformer recompiled at run time for each one (the
CPU's eager backend: a graph per prompt length, tests/models/test_z_image_compiled.py). Here
the captions and the joint sequence [image, caption] are padded further, to the caption's
text bucket (`CAPTION_BUCKETS`, the model's own multiples of 32 up to 64: a short prompt is as
long as the model makes it), with a mask: the layers see one shape per (bucket, rows) and compute
what they computed at the rows' own lengths (the padding is masked). The attention leaves the mask
out of the kernel (`ZeroedKeysProcessor`, models/zeroed_keys.py). Where every row's caption fills
its bucket there is no padding and no mask (`UnmaskedShapes`): the forward is the model's own,
kernel for kernel (an H100's masked forward of one row was 2% slower: the log-sum-exp's
correction, the zeroed keys' copies).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

from vllm_omni_like.models.text_buckets import text_bucket, zero_pad
from vllm_omni_like.models.zeroed_keys import has_lse_kernel, zeroed_keys_attention

CAPTION_MULTIPLE = 32  # the transformer pads each caption to a multiple of it (`SEQ_MULTI_OF`)
CAPTION_BUCKETS = (32, 64, 128, 256, 512)  # a caption's padded length: the smallest that holds it


class UnmaskedShapes:
    """The forwards that run without a mask: every row's caption fills its bucket, at a (rows,
    length) a compiled stage's warm-up ran so (a mask or none is a graph of its own: a shape the
    warm-up left masked stays masked, so no request compiles); until the warm-up ends
    (`freeze`), and on a stage never frozen (uncompiled), any."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, int, int]] = set()
        self.frozen = False

    def allows(self, kind: str, lengths: list[int], length: int) -> bool:
        """`kind`: the sequence ("caption", "joint": a joint length may equal a caption's)."""
        if any(n != length for n in lengths):
            return False
        key = (kind, len(lengths), length)
        if not self.frozen:
            self.seen.add(key)
        return key in self.seen


def pad_to(x: torch.Tensor, length: int) -> torch.Tensor:
    """`zero_pad`, with the strides of a new tensor of its shape (diffusers' frequencies are a
    slice whose strides follow the rows' lengths: a compiled block's guard). A slice of one row
    counts as contiguous whatever its first stride, so `contiguous()` would keep that stride:
    a single row (one model row: a row without guidance) would compile again."""
    out = zero_pad(x, length)
    if out.stride() == fresh_strides(out.shape):
        return out
    return out.clone(memory_format=torch.contiguous_format)


def fresh_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides a new contiguous tensor of `shape` has."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def key_mask(lengths: list[int], length: int, device: torch.device) -> torch.Tensor:
    """(B, `length`) True over each row's first `lengths[i]` positions (filled on the device:
    nothing copied from the host, so the loop never waits for the device here)."""
    mask = torch.zeros((len(lengths), length), dtype=torch.bool, device=device)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    return mask


def pad_sequences_to_buckets(transformer: Any) -> UnmaskedShapes:
    """Wrap the transformer's two paddings (its caption sequences, its joint sequence) so both
    reach the caption's text bucket, with a mask where one is padded; once per transformer.
    Returns which shapes run without a mask."""
    kept = getattr(transformer, "_unmasked_shapes", None)
    if isinstance(kept, UnmaskedShapes):
        return kept
    shapes = UnmaskedShapes()
    prepare, unify = transformer._prepare_sequence, transformer._build_unified_sequence

    def prepare_sequence(feats: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        out = prepare(feats, *args, **kwargs)
        pad_token = args[2] if len(args) > 2 else kwargs.get("pad_token")
        if pad_token is not transformer.cap_pad_token:  # the image's: all rows one length
            return out
        padded, freqs, _, lengths, noise = out
        length = text_bucket(max(lengths), CAPTION_BUCKETS)
        mask = (
            None
            if shapes.allows("caption", lengths, length)
            else key_mask(lengths, length, padded.device)
        )
        return pad_to(padded, length), pad_to(freqs, length), mask, lengths, noise

    def build_unified_sequence(
        x: torch.Tensor,
        x_freqs: torch.Tensor,
        x_lengths: list[int],
        x_noise: Any,
        cap: torch.Tensor,
        cap_freqs: torch.Tensor,
        cap_lengths: list[int],
        *rest: Any,
    ) -> Any:
        args = (x, x_freqs, x_lengths, x_noise, cap, cap_freqs, cap_lengths, *rest)
        unified, freqs, mask, noise = unify(*args)
        if noise is not None:  # (omni mode: images as conditions; not served)
            return unified, freqs, mask, noise
        length = max(x_lengths) + text_bucket(max(cap_lengths), CAPTION_BUCKETS)
        lengths = [a + b for a, b in zip(x_lengths, cap_lengths, strict=True)]
        joint = shapes.allows("joint", lengths, length)
        mask = None if joint else key_mask(lengths, length, unified.device)
        return pad_to(unified, length), pad_to(freqs, length), mask, noise

    transformer._prepare_sequence = prepare_sequence
    transformer._build_unified_sequence = build_unified_sequence
    transformer._unmasked_shapes = shapes
    return shapes


class ZeroedKeysProcessor(ZSingleStreamAttnProcessor):  # type: ignore[misc]  # untyped
    """Z-Image's attention (projections, QK norms, RoPE as diffusers' processor has them) with
    `zeroed_keys_attention` for a padded sequence (a (B, S) boolean mask); without one (the
    image's own refiner) or without a kernel with a log-sum-exp for it, diffusers' own."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        freqs_cis: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if (
            attention_mask is None
            or attention_mask.ndim != 2
            or attention_mask.dtype != torch.bool
            or not has_lse_kernel(hidden_states)
        ):
            out: torch.Tensor = super().__call__(
                attn, hidden_states, encoder_hidden_states, attention_mask, freqs_cis
            )
            return out
        q, k, v = rotated_qkv(attn, hidden_states, freqs_cis)
        joint = zeroed_keys_attention(q, k.to(q.dtype), v, attention_mask)
        return project_out(attn, joint.flatten(2, 3).to(q.dtype))


def rotated_qkv(
    attn: Any, hidden_states: torch.Tensor, freqs_cis: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Z-Image attention's heads (B, S, H, D) as diffusers' processor makes them: projected,
    QK-normed, the queries and keys rotated by `freqs_cis` where given."""
    q, k, v = (
        p(hidden_states).unflatten(-1, (attn.heads, -1)) for p in (attn.to_q, attn.to_k, attn.to_v)
    )
    q = q if attn.norm_q is None else attn.norm_q(q)
    k = k if attn.norm_k is None else attn.norm_k(k)
    if freqs_cis is not None:
        q, k = rotate(q, freqs_cis), rotate(k, freqs_cis)
    return q, k, v


def project_out(attn: Any, joint: torch.Tensor) -> torch.Tensor:
    """The attention's output projection (and its dropout, where it has one) over (B, S, H x D)."""
    output: torch.Tensor = attn.to_out[0](joint)
    if len(attn.to_out) > 1:
        output = attn.to_out[1](output)  # (dropout)
    return output


def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Z-Image's rotary embedding: (B, S, H, D) pairs as complex numbers times `freqs` (B, S,
    D/2), in float32, back in `x`'s dtype."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(pairs * freqs.unsqueeze(2)).flatten(3).type_as(x)


def use_zeroed_keys(transformer: Any) -> bool:
    """`ZeroedKeysProcessor` in every attention of a Z-Image transformer; whether every one
    had diffusers' processor (another one stays)."""
    attentions = [m for m in transformer.modules() if hasattr(m, "set_processor")]
    plain = [type(m.processor) is ZSingleStreamAttnProcessor for m in attentions]
    if not attentions or not all(plain):
        return False
    for module in attentions:
        module.set_processor(ZeroedKeysProcessor())
    return True


def block_targets(transformer: Any) -> list[tuple[Any, str]]:
    """(owner, name) of each transformer block (the refiners' and the main layers'): compiled
    one by one, the padding and patching between them eager (their shapes follow the rows'
    own lengths, which the blocks never see)."""
    lists = (transformer.noise_refiner, transformer.context_refiner, transformer.layers)
    return [(blocks, str(i)) for blocks in lists for i in range(len(blocks))]
