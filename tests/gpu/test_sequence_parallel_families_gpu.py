"""Sequence parallelism of Qwen-Image, SD3.5 and Z-Image on two GPUs (NCCL), in bfloat16; skipped
without two CUDA devices (CI). The CPU tests of the same splits in float32 (gloo, within 1e-5):
tests/models/test_{qwen_image,sd3,z_image}_sequence_parallel.py. Here the masked attentions take
their CUDA path (the padded keys zeroed, one unmasked cuDNN or flash call corrected by its
log-sum-exp, models/zeroed_keys.py), which the CPU never runs: the split forward in bfloat16
must be as close to one rank's float32 forward as one rank's own bfloat16 forward is."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.models import test_qwen_image_sequence_parallel as qwen
from tests.models import test_sd3_sequence_parallel as sd3
from tests.models import test_z_image_sequence_parallel as z_image
from tests.models.tiny_mmdit import tiny_sd3_path
from tests.models.tiny_qwen import tiny_qwen_image_path
from tests.models.tiny_z_image import tiny_z_image_path
from tests.parallel.gloo_ranks import run_ranks
from vllm_omni_like.models.qwen_image.sequence_parallel import split_qwen_image
from vllm_omni_like.models.sd3.sequence_parallel import split_sd3
from vllm_omni_like.models.z_image.sequence_parallel import split_z_image
from vllm_omni_like.parallel.ulysses import SequenceShards

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)


def _moved(x: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """`x` (tensors, lists, dicts of them) on `device`, its floating tensors in `dtype`."""
    if isinstance(x, torch.Tensor):
        return x.to(device, dtype) if x.is_floating_point() else x.to(device)
    if isinstance(x, list | tuple):
        return type(x)(_moved(i, device, dtype) for i in x)
    if isinstance(x, dict):
        return {k: _moved(v, device, dtype) for k, v in x.items()}
    return x


def _error(got: Any, want: Any) -> float:
    got, want = (g if isinstance(g, list) else [g] for g in (got, want))
    return max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want, strict=True))


def _case(rank: int, size: int, model: Any, kwargs: dict, split: Any) -> tuple[float, float]:
    """One rank's bfloat16 forward's error and the split one's, against one rank's float32."""
    device = torch.device("cuda", rank)
    model = model.to(device)
    with torch.inference_mode():
        exact = model(**_moved(kwargs, device, torch.float32))[0]
        model = model.to(torch.bfloat16)
        half = _moved(kwargs, device, torch.bfloat16)
        one = model(**half)[0]
        split(model, SequenceShards(rank, size, dist.group.WORLD))
        got = model(**half)[0]
    return _error(one, exact), _error(got, exact)


def _families(rank: int, size: int, paths: dict[str, str]) -> dict[str, tuple[float, float]]:
    q = qwen._load(paths["qwen"])
    s = sd3._load(paths["sd3"])
    z = z_image._load(paths["z"])
    return {
        "qwen-image-edit": _case(
            rank, size, q, qwen._inputs(q, qwen.EDIT, (12, 7), 1), split_qwen_image
        ),
        "sd3.5-medium": _case(rank, size, s, sd3._inputs(s, 6, 10, 1), split_sd3),
        "z-image": _case(rank, size, z, z_image._inputs(z, (10, 40), 1), split_z_image),
    }


def test_split_forwards_in_bfloat16_are_as_close_as_one_ranks():
    paths = {"qwen": tiny_qwen_image_path(), "sd3": tiny_sd3_path(True), "z": tiny_z_image_path()}
    for answer in run_ranks(_families, 2, paths, backend="nccl", timeout=300):
        for family, (one, split) in answer.items():
            assert split <= 2 * one + 1e-3, (family, one, split)
