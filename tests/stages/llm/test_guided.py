"""Guided decoding in the LLM stage (#20 part 3): constrained and free rows in one batch, every
constrained output checked against its constraint, a failing chat template ends its row alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from vllm_omni_like.config import StageConfig
from vllm_omni_like.errors import ErrorKind
from vllm_omni_like.params import GenerationParams, GuideSpec
from vllm_omni_like.pipelines.catalog import TINY_OPTIONS
from vllm_omni_like.shapes.world import caption_grammar, parse_caption
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.stages.llm.stage import LLMStage
from vllm_omni_like.wire import StageRequest

# schemas that force termination: enums, a const, bounded strings and arrays
SHAPE = {
    "type": "object",
    "properties": {
        "shape": {"enum": ["circle", "square", "triangle"]},
        "color": {"enum": ["red", "green", "blue"]},
        "large": {"type": "boolean"},
    },
    "required": ["shape", "color", "large"],
    "additionalProperties": False,
}
TAGS = {
    "type": "object",
    "properties": {
        "kind": {"const": "caption"},
        "words": {
            "type": "array",
            "items": {"type": "string", "maxLength": 6, "pattern": "^[a-z]+$"},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["kind", "words"],
    "additionalProperties": False,
}
CAPTION = caption_grammar().split("/")[1]  # the grammar's caption regex
TEMPLATE = (  # a chat template that refuses a role, as real ones do
    "{% for m in messages %}{% if m.role == 'tool' %}"
    "{{ raise_exception('tool messages are not supported') }}{% endif %}"
    "{{ m.content }} {% endfor %}<sep>"
)


def load(**options) -> LLMStage:
    opts = {**TINY_OPTIONS["tiny-llm"], **options}
    llm = LLMStage(StageConfig(name="llm", kind="llm", model="tiny-llm", options=opts))
    llm.load("cpu")
    return llm


@pytest.fixture(scope="module")
def stage():
    return load(output_grammar=None)  # free rows are free


def run(stage: LLMStage, rows: list[tuple[str, GenerationParams]]) -> list:
    batch = [StageRequest(f"r{i}", p, params, mode="text") for i, (p, params) in enumerate(rows)]
    control = StageControl(FaultInjector((), "llm"))
    return stage.begin(batch, control).finish(batch)


def guided(kind: str, value, **kw) -> GenerationParams:
    text = value if isinstance(value, str) else json.dumps(value)
    return GenerationParams(guide=GuideSpec(kind, text), max_new_tokens=60, **kw)


def test_constrained_and_free_rows_share_a_batch_and_each_output_keeps_its_constraint(stage):
    free = GenerationParams(max_new_tokens=16)
    sampled = dict(temperature=1.2, seed=4)
    rows = [
        ("a large red circle", guided("json_schema", SHAPE)),
        ("a blue square", free),
        ("three green words", guided("json_schema", TAGS, **sampled)),
        ("a small triangle", guided("regex", r"(small|large) (red|blue) [a-z]{2,8}")),
        ("pick one", guided("choice", ["a red circle", "a blue square"], **sampled)),
        ("a grammar", guided("grammar", 'start: "x=" NUM ";"\nNUM: /[0-9]{1,3}/')),
        ("any object", guided("json_schema", {"type": "object"}, **sampled)),
    ]
    outs = run(stage, rows)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    # every constraint but the last forces termination within the budget
    assert all(o.finish_reason == "stop" for o in outs[:-1]), [o.finish_reason for o in outs]
    jsonschema.validate(json.loads(outs[0].text), SHAPE)
    jsonschema.validate(json.loads(outs[2].text), TAGS)
    assert re.fullmatch(r"(small|large) (red|blue) [a-z]{2,8}", outs[3].text)
    assert outs[4].text in ("a red circle", "a blue square")
    assert re.fullmatch(r"x=[0-9]{1,3};", outs[5].text)
    if outs[6].finish_reason == "stop":  # any JSON object: it may run out of tokens
        assert isinstance(json.loads(outs[6].text), dict)
    else:
        assert outs[6].finish_reason == "length" and outs[6].completion_tokens == 60
        assert outs[6].text.startswith("{")
    # the free row is what it is alone: the constraints of its peers changed nothing for it
    (alone,) = run(stage, [("a blue square", free)])
    assert outs[1].text == alone.text == "a large blue square in the center on a black background"
    assert all(isinstance(o.completion_tokens, int) and o.completion_tokens > 0 for o in outs)
    assert all(o.prompt_tokens > 0 for o in outs)


def test_a_constraint_that_cannot_finish_in_time_ends_with_length(stage):
    """max_tokens cut a JSON object short: `finish_reason` says "length" and the text is a
    prefix of valid output, not valid itself."""
    (out,) = run(stage, [("x", GenerationParams(max_new_tokens=4, guide=GuideSpec(
        "json_schema", json.dumps(SHAPE))))])  # fmt: skip
    assert out.error is None and out.finish_reason == "length" and out.completion_tokens == 4
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)
    assert '{"shape": "circle"'.startswith(out.text)  # (the model spells it token by token)


def test_a_failing_chat_template_and_a_bad_regex_end_their_rows_alone(stage):
    stage.tokenizer.chat_template = TEMPLATE
    try:
        chat = (("system", "you draw"), ("user", "a red circle"))
        rows = [
            ("", GenerationParams(messages=chat, max_new_tokens=12)),
            ("", GenerationParams(messages=(("tool", "result"), ("user", "x")))),
            ("a red circle", GenerationParams(guide=GuideSpec("regex", "(unclosed"))),
            ("a red circle", GenerationParams(max_new_tokens=12)),
        ]
        outs = run(stage, rows)
    finally:
        stage.tokenizer.chat_template = None
    assert outs[1].error.kind is ErrorKind.INVALID and outs[1].error.code == "chat_template_failed"
    assert "tool messages are not supported" in outs[1].error.message
    assert outs[2].error.kind is ErrorKind.INVALID and outs[2].error.code == "invalid_constraint"
    assert "unclosed group" in outs[2].error.message
    # the template put the system turn and the user turn together: "you draw a red circle <sep>"
    assert outs[0].error is None and outs[0].prompt_tokens > outs[3].prompt_tokens
    assert outs[3].error is None
    assert outs[3].text == "a large red circle in the center on a black background"


def test_logprobs_are_the_models_and_name_each_token(stage):
    params = GenerationParams(max_new_tokens=6, logprobs=True, top_logprobs=3)
    (out,) = run(stage, [("a red circle", params)])
    assert len(out.logprobs) == len(out.token_ids) == 6
    assert "".join(e["token"] for e in out.logprobs) == out.text
    for entry in out.logprobs:
        tops = [t["logprob"] for t in entry["top_logprobs"]]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry["logprob"] == tops[0] <= 0  # greedy: the likeliest token was taken
        assert bytes(entry["bytes"]).decode() == entry["token"]


def test_the_tiny_rewriter_writes_only_the_caption_language():
    """Sampled hot, the rewriter strays from its captions; under the stage's output grammar
    (the catalog's for tiny-llm) every answer is a caption or the outside answer, and a greedy
    rewrite is what it was without the grammar."""
    guided_stage, free_stage = load(), load(output_grammar=None)
    prompts = ["a red circle", "zorbly flimp", "green square at the top", "a dog", "blue"] * 4
    hot = [GenerationParams(temperature=2.5, top_k=0, seed=s, max_new_tokens=24) for s in range(20)]
    rows = list(zip(prompts, hot, strict=True))
    free = [o.text for o in run(free_stage, rows) if o.error is None]
    kept = [(o.text, o.error) for o in run(guided_stage, rows)]
    strays = sum(parse_caption(t) is None for t in free)
    assert strays >= 5, free  # it does stray
    for text, error in kept:
        if error is not None:  # the outside answer: the request's 400
            assert error.code == "prompt_outside_model_domain"
        else:
            assert re.fullmatch(CAPTION, text), text
    greedy = [("a small green square at the top", GenerationParams())]
    assert run(guided_stage, greedy)[0].text == run(free_stage, greedy)[0].text
