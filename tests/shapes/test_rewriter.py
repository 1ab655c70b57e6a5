"""The default omni pipeline's rewriter (tiny-llm): it keeps what people type, says what it
cannot draw, and does not guess at words it never saw (#19). The full held-out figures come from
training/eval_omni.py; these are the cases a regression must not break."""

from __future__ import annotations

import openai
import pytest

from tests.api.conftest import live_server
from tests.shapes.test_trained_models import _control, _stage
from vllm_omni_like.models.tiny_llm import build_llm_tokenizer
from vllm_omni_like.shapes import world
from vllm_omni_like.wire import StageRequest

pytestmark = pytest.mark.slow

KEPT = {  # prompt -> what it names (the rest is the world's defaults)
    "a big yellow circle in the center on a black background": {
        "size": "large",
        "colour": "yellow",
        "shape": "circle",
        "position": "center",
        "background": "black",
    },
    "red circle on a blue background": {"colour": "red", "shape": "circle", "background": "blue"},
    "green triangle on a black background": {
        "colour": "green",
        "shape": "triangle",
        "background": "black",
    },
    "Please draw me a SMALL purple square in the upper right corner, thanks!": {
        "size": "small",
        "colour": "purple",
        "shape": "square",
        "position": "top right",
    },
    "On an orange background. A white triangle. Bottom left.": {
        "colour": "white",
        "shape": "triangle",
        "position": "bottom left",
        "background": "orange",
    },
    "a large red circle at the top left on a blue background": {
        "size": "large",
        "colour": "red",
        "shape": "circle",
        "position": "top left",
        "background": "blue",
    },
    "a tiny black square": {"size": "small", "colour": "black", "shape": "square"},
}
UNKNOWN = {  # a word the world does not have leaves its attribute to the defaults
    "a crimson circle on a blue background": {"shape": "circle", "background": "blue"},
    "a red hexagon on a white background": {"colour": "red", "background": "white"},
}
OUTSIDE = ["write me a poem", "a portrait of a cat", "a teal pentagon on a beige background"]


@pytest.fixture(scope="module")
def rewriter():
    return _stage("llm", "tiny-llm")


def _rewrite(stage, prompts):
    batch = [StageRequest(f"r{i}", p, mode="text") for i, p in enumerate(prompts)]
    return stage.execute(batch, _control())


def test_the_rewriter_keeps_every_named_attribute_and_fills_the_rest_with_the_defaults(rewriter):
    for (prompt, named), out in zip(KEPT.items(), _rewrite(rewriter, list(KEPT)), strict=True):
        assert out.error is None, (prompt, out.error)
        assert out.text == world.scene_from_named(named).caption(), (prompt, out.text)


def test_words_the_world_lacks_are_not_guessed(rewriter):
    """'crimson' is not read as red, nor 'hexagon' as any shape: the defaults stand in."""
    outs = _rewrite(rewriter, list(UNKNOWN))
    for (prompt, named), out in zip(UNKNOWN.items(), outs, strict=True):
        assert out.text == world.scene_from_named(named).caption(), (prompt, out.text)
    assert "red" not in outs[0].text.split()[:3]


def test_a_prompt_outside_the_world_fails_alone_in_its_batch(rewriter):
    prompts = [*OUTSIDE, "red circle"]
    outs = _rewrite(rewriter, prompts)
    for prompt, out in zip(OUTSIDE, outs[:-1], strict=True):
        assert out.error is not None and out.error.code == "prompt_outside_model_domain", prompt
        assert out.error.param == "prompt"
        assert "it draws one circle, square or triangle" in out.error.message
    assert outs[-1].error is None
    assert outs[-1].text == world.scene_from_named({"colour": "red", "shape": "circle"}).caption()


def test_unseen_words_split_into_known_pieces_not_one_unknown_token():
    tok = build_llm_tokenizer(["a red circle on a blue background", "a green square"], 300)
    for word in ("crimson", "hexagon", "Ünïcödé", "GREEN"):
        ids = tok(word, add_special_tokens=False).input_ids
        assert len(ids) >= 2 and tok.decode(ids) == word, (word, ids)
    assert tok.convert_ids_to_tokens(tok(world.OUTSIDE, add_special_tokens=False).input_ids) == [
        world.OUTSIDE
    ]


@pytest.fixture(scope="module")
def omni_server(tmp_path_factory):
    with live_server(tmp_path_factory, "tiny-omni") as server:
        yield server


def test_the_api_answers_400_prompt_outside_model_domain_with_what_the_model_draws(omni_server):
    client = omni_server.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(prompt="write me a poem", extra_body={"seed": 1})
    assert err.value.status_code == 400
    body = err.value.body
    assert body["code"] == "prompt_outside_model_domain" and body["param"] == "prompt"
    assert body["message"] == (
        f"stage 'llm': the prompt names nothing this model draws: it draws {world.describe()}"
    )
    res = client.images.generate(
        prompt="a crimson circle on a blue background", extra_body={"seed": 1}
    )
    assert res.data[0].revised_prompt == "a large white circle in the center on a blue background"
