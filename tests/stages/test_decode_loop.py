"""The LLM stage's own decode loop (#20 part 1): rows with different budgets and sampling share
every forward, and each equals its solo run for the same seed."""

from __future__ import annotations

import pytest
import torch

from vllm_omni_like.stages.decode_loop import DecodeLoop, RowSampling, choose, penalize
from vllm_omni_like.stages.tiny_models import ensure_tiny_model
from vllm_omni_like.stages.torch_utils import BatchDimProbe


@pytest.fixture(scope="module")
def lm():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_tiny_model("tiny-llm")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    probe = BatchDimProbe()
    probe.attach(model)
    return DecodeLoop(model, tok, torch.device("cpu")), tok, probe


ROWS = [  # prompt, settings: every knob differs from row to row
    ("red circle <sep>", RowSampling(max_new_tokens=12)),
    ("a tiny blue square at the top <sep>", RowSampling(max_new_tokens=5, temperature=0.8, seed=1)),
    (
        "green triangle on white <sep>",
        RowSampling(max_new_tokens=16, temperature=1.3, top_p=0.9, top_k=20, seed=7),
    ),
    (
        "zorbly flimp <sep>",
        RowSampling(
            max_new_tokens=9,
            temperature=1.0,
            seed=3,
            repetition_penalty=1.3,
            presence_penalty=0.5,
            frequency_penalty=0.4,
        ),
    ),
    ("purple circle bottom left <sep>", RowSampling(max_new_tokens=20, stop=(" on ",))),
]


def test_each_row_of_a_mixed_batch_equals_its_solo_run_and_the_rows_share_the_forward(lm):
    loop, tok, probe = lm
    prompts = [tok(p).input_ids for p, _ in ROWS]
    probe.reset()
    steps: list[tuple[int, int]] = []
    together = loop.run(prompts, [r for _, r in ROWS], lambda s, t: steps.append((s, t)))
    assert probe.max_seen == len(ROWS)  # one forward for all rows
    assert steps[-1][1] == 20 and [s for s, _ in steps] == list(range(1, len(steps) + 1))
    for prompt, (_, row), got in zip(prompts, ROWS, together, strict=True):
        (alone,) = loop.run([prompt], [row])
        assert got.token_ids == alone.token_ids and got.text == alone.text, row
        assert got.finish_reason == alone.finish_reason
        assert got.prompt_tokens == len(prompt)
        assert len(got.token_ids) <= row.max_new_tokens
    assert together[1].finish_reason == "length" and len(together[1].token_ids) == 5
    assert together[0].finish_reason == "stop"  # the rewriter ends its caption
    assert together[4].finish_reason == "stop" and " on " not in together[4].text
    assert together[4].text.startswith("a large purple circle at the bottom left")


def test_the_seed_decides_a_sampled_row():
    logits = torch.randn(50)
    row = RowSampling(max_new_tokens=1, temperature=1.0, seed=5)
    draws = [choose(logits.clone(), row, torch.Generator().manual_seed(s)) for s in (5, 5, 6, 7)]
    assert draws[0] == draws[1]
    assert choose(logits.clone(), RowSampling(max_new_tokens=1), None) == int(logits.argmax())


def test_top_k_and_top_p_keep_only_the_likeliest_tokens():
    logits = torch.tensor([5.0, 4.0, 3.0, -10.0, -10.0])
    gen = torch.Generator().manual_seed(0)
    picks = {
        choose(logits.clone(), RowSampling(1, temperature=5.0, top_k=2), gen) for _ in range(200)
    }
    assert picks == {0, 1}
    picks = {
        choose(logits.clone(), RowSampling(1, temperature=1.0, top_p=0.5), gen) for _ in range(200)
    }
    assert picks == {0}


def test_penalties_follow_hf_and_openai():
    logits = torch.tensor([2.0, -2.0, 1.0, 1.0])
    penalize(logits, RowSampling(1, repetition_penalty=2.0), seen=[0, 1], out=[])
    assert logits.tolist() == [1.0, -4.0, 1.0, 1.0]  # positive divided, negative multiplied
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0])
    penalize(logits, RowSampling(1, presence_penalty=0.5, frequency_penalty=0.25), [], [2, 2, 3])
    assert logits.tolist() == [1.0, 1.0, 0.0, 0.25]  # 1 - (0.5 + 0.25 * count)
