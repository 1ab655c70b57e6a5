"""Sequence parallelism through the stage (real worker processes, N gloo ranks a replica) for
the joint-attention families beyond FLUX.1: Qwen-Image (a masked text of its own length a row,
true CFG's two branches in one forward), Qwen-Image-Edit (the noise's tokens then the upload's)
SD3.5 (its joint attention without RoPE, MMDiT-X's second attention over the image alone) and
Z-Image (one unified sequence [image, caption] a row, padded and masked).
The same latents as one rank at the same seed within 1e-5 in float32, each rank's first block
its share of the tokens one rank's took (tests/stages/test_sequence_parallel.py's check)."""

from __future__ import annotations

import types

import pytest

from tests.models.test_family_contract import EDIT_IMAGE
from tests.models.tiny_mmdit import tiny_sd3_path
from tests.models.tiny_qwen import tiny_qwen_image_edit_path, tiny_qwen_image_path
from tests.models.tiny_z_image import tiny_z_image_path
from tests.stages.test_sequence_parallel import check_equal_to_one_rank
from vllm_omni_like.errors import ConfigError
from vllm_omni_like.models.adapter import Adapter
from vllm_omni_like.models.stable_diffusion import FAMILY as STABLE_DIFFUSION
from vllm_omni_like.parallel.patch_decode import Bands
from vllm_omni_like.parallel.ulysses import SequenceShards
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.wire import StageRequest

pytestmark = pytest.mark.slow


def test_a_family_without_a_split_is_refused_saying_so():
    """SD1.5 and SDXL (UNets): the load fails (the server does not start) with why."""
    adapter = Adapter(types.SimpleNamespace(), STABLE_DIFFUSION)
    with pytest.raises(ConfigError) as refused:
        adapter.split_sequence(SequenceShards(0, 2, None))
    assert str(refused.value) == "sequence parallelism does not run the stable-diffusion family yet"
    assert adapter.split_decode(Bands(0, 2, None)) is None  # (a decode on rank 0 alone)


def _image(rid: str, prompt: str, seed: int, steps: int, **more) -> StageRequest:
    """A text-to-image request, 80x48 unless `more` says otherwise (60 image tokens over the
    tiny VAE's factor 4 and the 2x2 packing)."""
    size = {"width": 80, "height": 48}
    params = GenerationParams(seed=seed, num_inference_steps=steps, **{**size, **more})
    return StageRequest(rid, prompt, params, mode="text2img")


def _qwen_requests() -> list[StageRequest]:
    """Two prompts of different token counts (each padded to the 64-token text bucket with
    its own mask, beside true CFG's negative " " in the same forward) at 60 and 140 image
    tokens (48x80 and 112x80 over the tiny VAE's factor 4 and the 2x2 packing: multiples of 4,
    not of 3)."""
    long = "a big blue square beside a small green triangle on a grey floor"
    return [_image("short", "a red circle", 1, 3), _image("long", long, 2, 2, height=112)]


def test_qwen_image_equals_one_rank_on_2_ranks(tmp_path):
    whole = check_equal_to_one_rank(tiny_qwen_image_path(), 2, _qwen_requests(), tmp_path)[1]
    assert whole == [60, 140]


@pytest.mark.drill  # (three and four ranks on two cores)
@pytest.mark.timeout(600)  # (several ranks on a loaded 2-core machine)
@pytest.mark.parametrize("n", [3, 4])
def test_qwen_image_equals_one_rank(tmp_path, n):
    """3 ranks divide neither sequence and split the 2 heads unevenly; 4 hold padding heads."""
    whole = check_equal_to_one_rank(tiny_qwen_image_path(), n, _qwen_requests(), tmp_path)[1]
    assert whole == [60, 140]


@pytest.mark.drill
@pytest.mark.timeout(600)  # (several ranks on a loaded 2-core machine)
@pytest.mark.parametrize("n", [2, 3])
def test_qwen_image_edit_equals_one_rank(tmp_path, n):
    """An upload read with each prompt by Qwen2.5-VL, its latents' tokens after the noise's in
    one sequence split over the ranks; the prediction cut to the noise's on rank 0."""
    requests = [
        StageRequest(
            rid,
            prompt,
            GenerationParams(seed=seed, num_inference_steps=2),
            mode="edit",
            images=[EDIT_IMAGE],
        )
        for rid, prompt, seed in (("a", "make it red", 3), ("b", "make the floor a lake", 4))
    ]
    check_equal_to_one_rank(tiny_qwen_image_edit_path(), n, requests, tmp_path)


@pytest.mark.drill
@pytest.mark.timeout(600)  # (several ranks on a loaded 2-core machine)
@pytest.mark.parametrize("n", [2, 3])
def test_sd35_medium_equals_one_rank(tmp_path, n):
    """SD3.5-medium's shape (MMDiT-X): 60 and 140 image tokens (48x80 and 112x80 over the tiny
    VAE's factor 4 and 2x2 patches), CFG's two branches in one forward, a text every rank
    holds whole; 3 ranks divide neither and pad the 4 heads to 6."""
    requests = [
        _image("short", "a red circle", 1, 3),
        _image("long", "a blue square", 2, 2, height=112, n=2),
    ]
    whole = check_equal_to_one_rank(tiny_sd3_path(True), n, requests, tmp_path)[1]
    assert whole == [60, 140]


@pytest.mark.drill
@pytest.mark.timeout(600)  # (several ranks on a loaded 2-core machine)
@pytest.mark.parametrize("n", [2, 3])
def test_z_image_equals_one_rank(tmp_path, n):
    """Two forwards: one with guidance whose negative prompt's caption (about 90 tokens) is
    longer than its prompt's, padded to the 128-token caption bucket beside it (a mask of keys
    over the padded unified sequence: 64 image tokens, the 48x80 image's 60 as the transformer
    pads them, then 128); one without, 80x80 (100 image tokens padded to 128, then 32). 3
    ranks divide the 160 unevenly."""
    negative = "a red circle and a blue square " * 12
    requests = [
        _image("guided", "a red circle", 1, 3, guidance_scale=0.5, negative_prompt=negative),
        _image("plain", "a blue square", 2, 2, height=80),
    ]
    whole = check_equal_to_one_rank(tiny_z_image_path(), n, requests, tmp_path)[1]
    assert whole == [160, 192]


@pytest.mark.drill
@pytest.mark.timeout(900)  # (the warm-up compiles every text bucket on 2 ranks of 2 cores)
@pytest.mark.parametrize("family", ["qwen-image", "z-image"])
def test_a_compiled_replica_equals_one_rank(tmp_path, family):
    """Compiled (dynamo's eager backend: real tracing, no C compiler), the split inside the
    compiled graphs (Qwen-Image's whole transformer; Z-Image's blocks one by one, the
    unified sequence's split and gather in its first and last main layers' hooks): rank 0's
    warm-up at load drives the others' (they serve its forwards)."""
    compiled = {
        "compile": True,
        "batch_buckets": (1,),
        "warmup_sizes": ("80x48",),  # (the request's; not the model's default megapixel)
        "options": {"compile_backend": "eager"},
    }
    path = tiny_qwen_image_path() if family == "qwen-image" else tiny_z_image_path()
    check_equal_to_one_rank(path, 2, [_image("c", "a red circle", 7, 2)], tmp_path, **compiled)


@pytest.mark.drill
@pytest.mark.timeout(600)  # (several ranks on a loaded 2-core machine)
@pytest.mark.parametrize("family", ["qwen-image", "z-image"])
def test_img2img_and_inpainting_edits_equal_one_rank(tmp_path, family):
    """An img2img edit and an inpainting edit (#55: our own loop) split over 2 ranks: each
    rank starts from the same latents (the upload's, noised at the strength's step), the
    inpainting row's unmasked region put back after each step on every rank."""
    import numpy as np

    mask = np.zeros(EDIT_IMAGE.shape[:2], np.uint8)
    mask[10:30, 20:60] = 255
    params = GenerationParams(seed=5, num_inference_steps=4, width=80, height=48, strength=0.6)
    requests = [
        StageRequest("e", "a red circle", params, mode="edit", images=[EDIT_IMAGE]),
        StageRequest("m", "a blue square", params, mode="edit", images=[EDIT_IMAGE], mask=mask),
    ]
    path = tiny_qwen_image_path() if family == "qwen-image" else tiny_z_image_path()
    check_equal_to_one_rank(path, 2, requests, tmp_path)
