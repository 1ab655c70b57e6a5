"""LoRA adapters on a CFG-parallel stage (parallel/cfg_parallel.py, stages/diffusion/lora_pool.py)
on the CPU: two gloo ranks in real worker processes, both holding the LoRA pool. Rank 0 alone
reads the files and writes each slot as a row joins; the slot is sent to rank 1 in order with
the forwards, and each unconditional forward's rows (slots, scales) go with its inputs. The
same latents as one rank running the same batch with its branches in two forwards, in float32
within 1e-5 (tests/stages/test_cfg_parallel_loop.py's check)."""

from __future__ import annotations

import pytest
import torch

from tests.stages.diffusion.lora_helpers import low_rank, write_peft
from tests.stages.test_cfg_parallel_loop import _request, _rows, check_equal_to_one_rank
from vllm_omni_like.models.tiny import ensure_tiny_model
from vllm_omni_like.params import LoraRef

pytestmark = pytest.mark.slow


def _adapters(tmp_path) -> dict:
    """Three adapters of the tiny UNet (its attention and MLP layers), registered."""
    import diffusers

    unet = diffusers.UNet2DConditionModel.from_pretrained(
        ensure_tiny_model("tiny-image"), subfolder="unet", dtype=torch.float32
    )
    files = {
        n: write_peft(tmp_path / f"{n}.safetensors", low_rank(unet, s, 4))
        for n, s in (("v", 1), ("w", 2), ("u", 3))
    }
    return {"loras": tuple(f"{n}={f}" for n, f in files.items()), "max_lora_rank": 4}


def test_lora_rows_mixed_and_joining_equal_one_rank(tmp_path):
    """One batch of a row with one adapter, one with two (another scale) and a base row (the
    same seed as the first), all with guidance; at its second step a row whose adapter no row
    used yet joins (its slot written mid-set reaches rank 1 before the forward that reads it).
    Every row's latents equal one rank's; rank 1 ran the unconditional rows."""

    def image(rid: str, seed: int, steps: int, *refs: LoraRef) -> object:
        return _request(
            rid, "text2img", seed=seed, num_inference_steps=steps, guidance_scale=5.0, loras=refs
        )

    groups = [
        [
            image("v", 1, 4, LoraRef("v")),
            image("base", 1, 4),
            image("vw", 2, 4, LoraRef("v", 0.7), LoraRef("w")),
        ],
        [image("u", 3, 3, LoraRef("u", 1.5))],
    ]
    one = tmp_path / "one"
    check_equal_to_one_rank("tiny-image", groups, tmp_path, both=_adapters(tmp_path))
    assert sum(_rows(tmp_path / "split", 1)) == 3 * 4 + 3  # every unconditional row
    got = {r: torch.load(one / f"{r}.pt") for r in ("v", "base")}
    assert (got["v"] - got["base"]).abs().mean() > 0.01  # (the adapter does something)


@pytest.mark.drill  # (4 processes and a reference: CFG-parallel x sequence parallelism)
def test_lora_rows_equal_one_rank_on_2_x_2_ranks(tmp_path):
    """CFG-parallel x sequence parallelism: rank 0 copies each slot into its group's rank 1 and
    to rank 2, which copies it into its group's rank 3; each forward's rows go with it. tiny-
    video's rows of one adapter, two and none, in one batch, equal one rank's (its branches in
    two forwards)."""
    from tests.stages.replica_ranks import lora_videos
    from tests.stages.test_sequence_parallel import check_equal_to_one_rank as sp_check

    loras, requests = lora_videos(tmp_path)
    both = {"loras": loras, "max_lora_rank": 4, "together": True, "batched_cfg": False}
    sp_check("tiny-video", 2, requests, tmp_path, both=both, cfg_parallel=True)
    got = {r: torch.load(tmp_path / "one" / f"{r}.pt") for r in ("v", "base")}
    assert (got["v"] - got["base"]).abs().mean() > 0.01  # (the adapter does something)
