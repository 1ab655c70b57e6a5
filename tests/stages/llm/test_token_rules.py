"""The LLM stage's own decode loop (#20 part 1), a running set since #35: rows with different
budgets and sampling share every forward, join and leave at any step, and each equals its solo
run for the same seed."""

from __future__ import annotations

import pytest
import torch

from vllm_omni_like.models.tiny import ensure_tiny_model
from vllm_omni_like.stages.llm.sampling import RowSampling, choose, penalize
from vllm_omni_like.stages.llm.token_batch import DecodeSet
from vllm_omni_like.stages.llm.token_rules import RowDecoder, RowResult
from vllm_omni_like.stages.torch_utils import BatchDimProbe


@pytest.fixture(scope="module")
def lm():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_tiny_model("tiny-llm")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    probe = BatchDimProbe()
    probe.attach(model)
    return Loop(model, RowDecoder(model, tok, None)), tok, probe


class Loop:
    """Rows through a `DecodeSet`: joined (all at first, or some at a later step), stepped until
    every one ended."""

    def __init__(self, model, decoder: RowDecoder) -> None:
        self.model, self.decoder = model, decoder
        self.widths: list[tuple[int, ...]] = []  # the set's mask (rows, columns) a step

    def run(self, prompts, rows, on_step=lambda s, t, d: None, later=None) -> list[RowResult]:
        """`later`: {step: [(prompt, row)]} rows that join after that many steps (their
        results follow the first rows', in order)."""
        dset = DecodeSet(self.model, self.decoder, torch.device("cpu"))
        entries = [(str(i), p, r) for i, (p, r) in enumerate(zip(prompts, rows, strict=True))]
        dset.join(entries)
        waiting = dict(later or {})
        results: dict[str, RowResult] = {}
        step, n = 0, len(entries)
        while dset.rows or waiting:
            if step in waiting:
                joining = waiting.pop(step)
                dset.join([(str(n + i), p, r) for i, (p, r) in enumerate(joining)])
                n += len(joining)
            stepped = dset.step(set(dset.keys), lambda keys: None, lambda point, key: None)
            if stepped is not None:
                step += 1
                total = max(of for _, of in stepped.progress.values())
                on_step(step, total, {int(k): d for k, d in stepped.deltas.items()})
            results.update(dset.leave(set(dset.keys)))
            self.widths.append(tuple(dset.mask.shape))
        return [results[str(i)] for i in range(n)]


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
    together = loop.run(prompts, [r for _, r in ROWS], lambda s, t, d: steps.append((s, t)))
    assert probe.max_seen == len(ROWS)  # one forward for all rows
    assert [s for s, _ in steps] == list(range(1, len(steps) + 1))
    assert steps[0][1] == 20  # the longest budget of the rows in the set
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


def test_a_row_failing_at_any_per_row_point_ends_alone_and_its_peers_finish():
    """Fault points in a real worker: one row's chat template and another's tokenization fail
    as the request's fault (400) before the first forward, a constrained row's constraint and
    another's detokenization fail mid-generation as the server's (500); each ends alone, the
    two healthy rows of the same batch finish exactly as they would have, and the worker serves
    on."""
    import json
    import queue

    from tests.conftest import drain_batch
    from vllm_omni_like.config import FaultRule, StageConfig
    from vllm_omni_like.errors import ErrorKind
    from vllm_omni_like.executor import MultiprocExecutor
    from vllm_omni_like.params import GenerationParams, GuideSpec
    from vllm_omni_like.pipelines.catalog import TINY_OPTIONS
    from vllm_omni_like.wire import ExecuteBatch, Progress, RequestResult, StageRequest

    faults = (
        FaultRule("llm", "template", "invalid", match="@badtpl"),
        FaultRule("llm", "tokenize", "invalid", match="@badtok"),
        FaultRule("llm", "constraint", "raise", match="@badcon"),
        FaultRule("llm", "detokenize", "raise", match="@baddetok"),
    )
    guide = GuideSpec("json_schema", json.dumps({"enum": ["red", "blue"]}))
    sink: queue.Queue = queue.Queue()
    config = StageConfig(name="llm", kind="llm", model="tiny-llm", options=TINY_OPTIONS["tiny-llm"])
    ex = MultiprocExecutor(config, 0, sink.put, faults)
    ex.start()

    def run(batch_id: int, prompts: list[str]) -> tuple[dict, list]:
        reqs = [
            StageRequest(
                f"{batch_id}-{i}",
                p,
                GenerationParams(guide=guide if "@badcon" in p else None),
                mode="text",
            )
            for i, p in enumerate(prompts)
        ]
        ex.execute(ExecuteBatch(batch_id, reqs))
        msgs = drain_batch(sink, batch_id, timeout=60)
        results = [m for m in msgs if isinstance(m, RequestResult)]
        assert len({m.output.request_id for m in results}) == len(results)  # each one once
        return {m.output.request_id: m.output for m in results}, msgs

    try:
        prompts = [
            "red circle",
            "blue square @badtok",
            "green @baddetok",
            "a tiny white square",
            "a square @badtpl",
            "a colour @badcon",
        ]
        mixed, msgs = run(1, prompts)
        done = msgs[-1]
        clean, _ = run(2, ["red circle", "a tiny white square"])
        for i, kind, point in (
            (1, ErrorKind.INVALID, "injected invalid fault at tokenize"),
            (2, ErrorKind.GENERATE, "injected raise fault at detokenize"),
            (4, ErrorKind.INVALID, "injected invalid fault at template"),
            (5, ErrorKind.GENERATE, "injected raise fault at constraint"),
        ):
            assert mixed[f"1-{i}"].error.kind is kind and mixed[f"1-{i}"].text is None
            assert point in mixed[f"1-{i}"].error.message
        assert done.model_batch_dim == 4  # the rows that failed before the first forward: out
        # each failed row went out the moment it failed: before the first step for those that
        # failed at admission, at the first step for those that failed mid-generation, so before
        # the rows still decoding
        at = {m.output.request_id: k for k, m in enumerate(msgs) if isinstance(m, RequestResult)}
        first_step = next(k for k, m in enumerate(msgs) if isinstance(m, Progress))
        assert max(at["1-1"], at["1-4"]) < first_step
        assert max(at["1-2"], at["1-5"]) < min(at["1-0"], at["1-3"])
        assert mixed["1-0"].text == clean["2-0"].text and mixed["1-0"].error is None
        assert mixed["1-3"].text == clean["2-1"].text and mixed["1-3"].error is None
        assert mixed["1-0"].text == "a large red circle in the center on a black background"
    finally:
        ex.shutdown()


def test_streamed_rows_hand_out_their_text_step_by_step_and_hold_back_a_stop_string(lm):
    """Deltas joined are the final text, for a row cut by a stop string too (the stop string's
    start is held back until it is clear whether the stop string follows); rows that do not
    stream hand out nothing."""
    loop, tok, _ = lm
    rows = [
        RowSampling(max_new_tokens=20, stream=True),
        RowSampling(max_new_tokens=20, stream=True, stop=(" on a",)),
        RowSampling(max_new_tokens=20),
    ]
    prompts = [tok(p + " <sep>").input_ids for p in ("a red circle", "a blue square", "green")]
    got: dict[int, list[str]] = {0: [], 1: [], 2: []}
    steps = []

    def on_step(step, total, deltas):
        steps.append(step)
        for i, d in deltas.items():
            got[i].append(d.text)
            assert len(d.token_ids) <= 1

    results = loop.run(prompts, rows, on_step)
    assert got[2] == [] and steps == list(range(1, len(steps) + 1))
    whole = "a large red circle in the center on a black background"
    assert "".join(got[0]) == results[0].text == whole
    assert "".join(got[1]) == results[1].text == "a large blue square in the center"
    assert results[1].finish_reason == "stop"
    assert sum(1 for t in got[0] if t) >= 5  # word by word, not at the end


def test_rows_that_join_at_a_later_step_equal_their_solo_runs_and_leaving_rows_free_the_cache(lm):
    """Two rows run; after 3 steps two more join (one with a longer prompt than any in the
    set), after 7 one more: each equals its solo run; the set's cache holds only the rows still
    in it, cut to the columns they attend to."""
    loop, tok, probe = lm
    prompts = [tok(p).input_ids for p, _ in ROWS]
    rows = [r for _, r in ROWS]
    probe.reset()
    later = {3: [(prompts[2], rows[2]), (prompts[1], rows[1])], 7: [(prompts[4], rows[4])]}
    loop.widths = []
    got = loop.run([prompts[0], prompts[3]], [rows[0], rows[3]], later=later)
    for i, result in zip([0, 3, 2, 1, 4], got, strict=True):
        (alone,) = loop.run([prompts[i]], [rows[i]])
        assert result.token_ids == alone.token_ids and result.text == alone.text, ROWS[i]
        assert result.finish_reason == alone.finish_reason
    assert probe.max_seen <= 5
    # (rows, columns) of the set after each step: rows leave as they end; once the long prompt
    # has left, the set's cache is no wider than what its remaining rows attend to
    sizes = loop.widths
    assert max(r for r, _ in sizes) >= 3 and sizes[-1] == (0, 0)
    longest = max(len(p) for p in prompts)
    assert all(c <= longest + 20 for _, c in sizes)
