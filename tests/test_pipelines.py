import pytest

from vllm_omni_like.errors import ConfigError
from vllm_omni_like.inputs import OmniRequest
from vllm_omni_like.outputs import StageOutput
from vllm_omni_like.pipelines.base import Pipeline
from vllm_omni_like.pipelines.catalog import builtin, from_yaml, resolve
from vllm_omni_like.stage_options import LLMOptions


def test_example_yaml_describes_a_two_stage_pipeline():
    (p,) = from_yaml("examples/pipeline.yaml")
    assert p.name == "my-omni" and p.output == "image"
    llm, diffusion = p.stages
    assert (llm.kind, llm.model) == ("llm", "tiny-llm")
    assert llm.options == LLMOptions(max_new_tokens=24, prompt_template="{prompt} <sep>")
    assert (diffusion.replicas, diffusion.max_batch_size, diffusion.stall_timeout) == (2, 8, 60)


def test_overrides_apply_to_every_stage():
    (p,) = resolve("examples/pipeline.yaml", replicas=3)
    assert [s.replicas for s in p.stages] == [3, 3]
    assert [s.max_batch_size for s in builtin("tiny-omni", max_batch_size=4).stages] == [4, 4]


def test_unknown_specs(tmp_path):
    with pytest.raises(ConfigError, match="unknown model 'nope'"):
        resolve("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("pipelines: [{name: x}]\n")
    with pytest.raises(ConfigError, match="bad pipeline entry"):
        from_yaml(str(bad))
    (tmp_path / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    (d,) = resolve(str(tmp_path), llm="/models/llm")
    assert d.output == "video" and [s.kind for s in d.stages] == ["llm", "diffusion"]


def test_llm_text_becomes_the_next_prompt():
    p = Pipeline(builtin("tiny-omni"))
    req = OmniRequest("r", "red circle", "tiny-omni")
    first = p.stage_request(req, 0, None)
    assert (first.mode, first.prompt, first.truncate_prompt) == ("text", "red circle", False)
    prev = StageOutput("r", "llm", text="a red circle at the top left")
    second = p.stage_request(req, 1, prev)
    assert (second.mode, second.prompt, second.truncate_prompt) == (
        "text2img",
        "a red circle at the top left",
        True,
    )
    assert Pipeline.revised_prompt({"llm": prev}) == "a red circle at the top left"


def test_model_limits_come_from_the_model_and_yaml_or_flags_override_them():
    import argparse

    from vllm_omni_like import flags
    from vllm_omni_like.models.limits import pipeline_limits

    (yaml_pipeline,) = from_yaml("examples/pipeline.yaml")
    limits = pipeline_limits(yaml_pipeline)
    assert (limits.max_side, limits.max_pixels) == (96, 4 * 96 * 96)  # the YAML's max_side
    own = pipeline_limits(builtin("tiny-image"))
    assert (own.max_side, own.max_steps, own.size_multiple) == (128, 200, 8)
    parser = argparse.ArgumentParser()
    flags.add_engine_args(parser)
    args = parser.parse_args(["--max-side", "64", "--max-steps", "30", "--max-frames", "17"])
    video = pipeline_limits(builtin("tiny-video", **flags.stage_overrides(args)))
    assert (video.max_side, video.max_steps, video.max_frames) == (64, 30, 17)
    assert pipeline_limits(builtin("tiny-video")).max_frames == 33  # what it was trained for
    with pytest.raises(ConfigError, match="max_side must be an integer >= 1"):
        builtin("tiny-image", max_side=0)


def test_a_diffusion_stage_is_described_by_its_family_and_each_modes_loop():
    import json

    from vllm_omni_like.models.limits import StageFamily, describe_stage

    (stage,) = builtin("tiny-image").stages
    family = describe_stage(stage)
    assert family == {
        "family": "stable-diffusion",
        "loop": "own",
        "loops": {"text2img": "own", "edit": "own", "inpaint": "own"},
    }
    assert set(family) == set(StageFamily.__annotations__)  # the TypedDict's keys, no other
    assert json.loads(json.dumps(family)) == family  # (its modes are strings in /health)
    assert describe_stage(builtin("null-image").stages[-1]) is None
