"""Z-Image beyond the contract suite: with guidance (its own formula, above 0) the stage makes
what ZImagePipeline makes; rows of their own token counts and guidance joining a set make what
they make alone; a step hands each row its own tokens without reading a value back; the
pipeline's call leaves the prompts it was given as they were."""

from __future__ import annotations

import diffusers
import numpy as np
import pytest
import torch

from tests.models.test_mmdit import WaitSpy
from tests.models.tiny_z_image import tiny_z_image_path
from tests.stages.diffusion.test_running_set import _alone, _Harness, _req
from vllm_omni_like.config import StageConfig
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.diffusion.running_set import OwnLoopSet
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.stages.torch_utils import tensor_to_uint8
from vllm_omni_like.wire import StageRequest

pytestmark = pytest.mark.slow
LONG = "a red circle and a blue square " * 12  # past the first text bucket


@pytest.fixture(scope="module")
def stage() -> DiffusionStage:
    stage = DiffusionStage(
        StageConfig(name="diffusion", kind="diffusion", model=tiny_z_image_path())
    )
    stage.load("cpu")
    return stage


def test_with_guidance_the_stage_makes_what_the_pipeline_makes(stage):
    params = GenerationParams(
        seed=7, num_inference_steps=3, guidance_scale=0.5, negative_prompt="a green triangle"
    )
    (out,) = stage.execute(
        [StageRequest("r", "a red circle", params)], StageControl(FaultInjector((), "d"))
    )
    assert out.error is None, out.error
    pipe = diffusers.DiffusionPipeline.from_pretrained(
        tiny_z_image_path(), local_files_only=True, dtype=torch.float32
    )
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        want = pipe(
            prompt=["a red circle"],
            negative_prompt=["a green triangle"],
            guidance_scale=0.5,  # (above 0: guided, unlike our other families' 1)
            num_inference_steps=3,
            generator=[torch.Generator().manual_seed(7)],
            width=64,
            height=64,
            output_type="pt",
        ).images
    got, want = out.images[0].pixels.astype(int), tensor_to_uint8(want)[0].astype(int)
    assert got.shape == (64, 64, 3) and np.abs(got - want).max() <= 1


def test_the_pipelines_call_leaves_the_prompts_it_was_given_as_they_were(stage):
    """ZImagePipeline writes each prompt's chat template into the list it gets: the adapter's
    arguments are copies, so a caller's prompts (a batch's, a warm-up's kept for the next
    call) do not grow by a template a call."""
    prompts, negatives = ["a red circle"], ["a green triangle"]
    kwargs = stage.runtime.adapter.text_kwargs(prompts, negatives, None)
    with torch.inference_mode():
        stage.runtime.adapter.pipe(
            **kwargs,
            guidance_scale=0.5,
            num_inference_steps=1,
            width=64,
            height=64,
            output_type="latent",
        )
    assert prompts == ["a red circle"] and negatives == ["a green triangle"]


def test_rows_of_their_own_lengths_and_guidance_joining_a_set_make_what_they_make_alone(stage):
    a = _req("a", seed=3, steps=5, prompt="a red circle", guidance_scale=2.0)
    b = _req("b", seed=4, steps=4, prompt=LONG)  # no guidance, the second text bucket
    c = _req("c", seed=5, steps=4, prompt="a blue square", guidance_scale=3.0, negative_prompt=LONG)
    alone = {r.request_id: _alone(stage, r) for r in (a, b, c)}
    h = _Harness(stage)
    h.add(1, a)
    h.steps(1)
    h.add(2, b, c)
    h.steps()
    for rid, image in alone.items():
        assert np.abs(h.pixels(rid) - image).max() <= 1, rid


def test_a_step_hands_each_row_its_tokens_without_waiting(stage):
    rowset, control = OwnLoopSet(stage.runtime), StageControl(FaultInjector((), "diffusion"))
    requests = [
        StageRequest("a", "a red circle", GenerationParams(seed=1, num_inference_steps=4)),
        StageRequest(
            "b", LONG, GenerationParams(seed=2, num_inference_steps=4, guidance_scale=2.0)
        ),
    ]
    rowset.join(requests, control)
    spy = WaitSpy()
    with spy:
        for _ in range(2):
            assert rowset.step(control)
    assert spy.waits == []


def test_its_text_is_the_pipelines_read_at_the_caption_bucket_without_a_sync():
    """Qwen3 run at the caption bucket of the longest prompt (not the pipeline's 512 tokens)
    gives the pipeline's own states, bit for bit on the CPU, a truncated prompt's too; the
    token counts come from the host (no `nonzero`: the pipeline's boolean-mask read)."""
    from torch.profiler import profile

    from vllm_omni_like.models.adapter import adapter_for
    from vllm_omni_like.models.registry import family_of

    path = tiny_z_image_path()
    pipe = diffusers.DiffusionPipeline.from_pretrained(path, local_files_only=True)
    adapter = adapter_for(pipe, family_of(path))
    texts = ["a red fox", "red " * 40, None, "word " * 600]  # (the last: past 512 tokens)
    cpu = torch.device("cpu")
    with torch.inference_mode(), profile() as prof:
        got = adapter.encode_text(texts, cpu, 0)
    assert "aten::nonzero" not in {e.key for e in prof.key_averages()}
    with torch.inference_mode():
        rows = pipe._encode_prompt(prompt=[t or "" for t in texts], device=cpu)
    assert got["lengths"].tolist() == [r.shape[0] for r in rows]
    assert got["embeds"].shape[1] == 512 and got["mask"].shape == (4, 512)
    for i, row in enumerate(rows):
        n = row.shape[0]
        assert torch.equal(got["embeds"][i, :n], row)
        assert not got["embeds"][i, n:].any() and int(got["mask"][i].sum()) == n
    short = adapter.encode_text(["a red fox"], cpu, 0)
    assert short["embeds"].shape[1] == 32  # (its own bucket: 32 tokens read, not 512)
