"""Qwen-Image beyond the contract suite: the synthesized chat tokenizer gives the template
prefix the pipeline cuts its 34 tokens; prompts of their own lengths (across a text-length
bucket), negative prompts, rows with and without guidance and a request joining a busy set all
make the image each makes alone; one step, undefined for its schedule, is refused; a compiled
stage runs every text bucket on its warm-up's graphs."""

from __future__ import annotations

import dataclasses

import diffusers
import numpy as np
import pytest
import torch

from tests.models.tiny_qwen import tiny_qwen_image_path
from tests.stages.diffusion.test_running_set import _alone, _Harness, _req
from vllm_omni_like.config import StageConfig
from vllm_omni_like.errors import InvalidRequestError
from vllm_omni_like.models.chat_tokenizer import build_chat_tokenizer
from vllm_omni_like.models.limits import diffusion_limits
from vllm_omni_like.models.text_buckets import TEXT_BUCKETS
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.protocol.admission import check_steps
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.wire import StageRequest

pytestmark = pytest.mark.slow
OPTIONS = {"default_size": 64}  # (the family's native 1024 is a real model's)
LONG = "a red circle and a blue square " * 12  # past the first text bucket


@pytest.fixture(scope="module")
def stage() -> DiffusionStage:
    config = StageConfig(
        name="diffusion", kind="diffusion", model=tiny_qwen_image_path(), options=OPTIONS
    )
    stage = DiffusionStage(config)
    stage.load("cpu")
    return stage


def test_the_template_prefix_the_pipeline_cuts_is_its_system_prompt():
    pipe = diffusers.DiffusionPipeline.from_pretrained(
        tiny_qwen_image_path(), local_files_only=True, dtype=torch.float32
    )
    template, cut = pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx
    tokenizer = build_chat_tokenizer()
    prefix = template[: template.index("{}")]
    assert cut == 34 and len(tokenizer(prefix).input_ids) == cut
    ids = tokenizer(template.format("a red circle")).input_ids
    assert tokenizer.convert_ids_to_tokens(ids[cut : cut + 3]) == ["a", "red", "circle"]
    assert "<unk>" not in tokenizer.convert_ids_to_tokens(ids)  # its words are all known
    embeds, mask = pipe.encode_prompt(prompt=["a red circle", LONG], device="cpu")
    lengths = mask.sum(dim=1).tolist()  # the prompt's own tokens and the template's last 5
    assert lengths == [3 + 5, len(LONG.split()) + 5] and embeds.shape[1] == max(lengths)


def test_texts_are_padded_to_their_bucket_with_a_mask(stage):
    with torch.inference_mode():
        adapter = stage.runtime.adapter
        text = adapter.encode_text(["a red circle", None, LONG], torch.device("cpu"), 0)
    assert text["embeds"].shape[1] == text["mask"].shape[1] == TEXT_BUCKETS[1]
    # None: " " (a word-level tokenizer keeps no space: the template's last 5 tokens alone)
    assert text["mask"].sum(dim=1).tolist() == [8, 5, len(LONG.split()) + 5]
    assert not text["embeds"][0, 8:].any()  # the padding: masked zeros


def test_rows_of_their_own_lengths_and_guidance_joining_a_set_make_what_they_make_alone(stage):
    a = _req("a", seed=3, steps=6, prompt="a red circle", negative_prompt=LONG)
    b = _req("b", seed=4, steps=4, prompt=LONG, guidance_scale=1.0)  # no CFG, bucket 128
    c = _req("c", seed=5, steps=5, prompt="a blue square", guidance_scale=6.0)
    alone = {r.request_id: _alone(stage, r) for r in (a, b, c)}
    h = _Harness(stage)
    h.add(1, a)
    h.steps(2)  # a's texts fill bucket 64 (its negative: 128)
    h.add(2, b, c)  # joins at step 2
    h.steps()
    for rid, image in alone.items():
        assert np.abs(h.pixels(rid) - image).max() <= 1, rid
    assert np.abs(h.pixels("a") - h.pixels("c")).mean() > 1  # (distinct images)


def test_one_step_is_refused_where_it_is_undefined(stage):
    limits = diffusion_limits(stage.config)
    assert limits.min_steps == 2 and limits.as_dict()["min_steps"] == 2
    one = GenerationParams(num_inference_steps=1)
    with pytest.raises(InvalidRequestError, match="under tiny's minimum of 2") as exc:
        check_steps(one, limits, "tiny")
    assert exc.value.param == "num_inference_steps"
    with pytest.raises(InvalidRequestError, match=r"within 2\.\.200"):
        stage.validate(StageRequest("r", "a red circle", one))
    stage.validate(
        StageRequest("r", "a red circle", dataclasses.replace(one, num_inference_steps=2))
    )


@pytest.mark.drill  # (every text bucket compiled: ~21 s; Z-Image's buckets run by default)
def test_a_compiled_stage_runs_every_text_bucket_on_its_warm_up_graphs(stage):
    """Its warm-up ran a prompt a text bucket (models/text_buckets.py): a prompt of another
    bucket than the first, true CFG's two lengths beside it, compiles nothing at run time."""
    from torch._dynamo.utils import counters

    from tests.stages.diffusion.test_compiled import _control

    config = StageConfig(
        name="diffusion",
        kind="diffusion",
        model=tiny_qwen_image_path(),
        compile=True,
        max_batch_size=1,
        batch_buckets=(1,),
        options={**OPTIONS, "compile_backend": "eager"},
    )
    compiled = DiffusionStage(config)
    compiled.load("cpu")
    graphs = counters["stats"]["unique_graphs"]

    def image(on: DiffusionStage, prompt: str) -> np.ndarray:
        params = GenerationParams(seed=3, num_inference_steps=2)
        (out,) = on.execute([StageRequest("r", prompt, params)], _control())
        assert out.error is None, out.error
        return out.images[0].pixels.astype(int)

    for prompt in ("a red circle", LONG, LONG * 2):  # buckets 64, 128, 256
        assert np.abs(image(compiled, prompt) - image(stage, prompt)).max() <= 1, prompt
    assert counters["stats"]["unique_graphs"] == graphs
