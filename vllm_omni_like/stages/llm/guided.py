"""Guided decoding: a row's tokens kept inside a JSON schema, a regex, a choice list or a Lark
grammar, with llguidance (the library vLLM and SGLang use) behind this small interface.

`Guides` belongs to one tokenizer: it compiles a request's `GuideSpec` into a grammar (cached:
the same schema is compiled once), starts a matcher per row, and computes the batch's allowed
tokens as a bitmask on the CPU (all constrained rows at once, on llguidance's threads), which
`apply_masks` turns into -inf logits. A row's matcher follows every token the row takes; when the
grammar is complete (nothing more may follow) the row ends with `finish_reason` "stop"; the end
of sequence token is allowed exactly when the output so far is complete.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from vllm_omni_like.errors import InvalidRequestError
from vllm_omni_like.params import GuideSpec

if TYPE_CHECKING:  # (llguidance is imported where a grammar is first needed)
    from llguidance._lib import JsonCompileOptions

CACHED_GRAMMARS = 64
# JSON as json.dumps writes it: no free whitespace (a model cannot pad its output forever, and
# the bytes are what a client expects); keywords llguidance does not implement are an error
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GuideError(RuntimeError):
    """The matcher refused a token the mask allowed (ours to fix: a 500, never the request's)."""


def _lark_choice(choices: list[str]) -> str:
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequestError(
            "a choice list needs one or more non-empty strings", param="response_format"
        )
    return "start: " + " | ".join(json.dumps(c) for c in choices)


class Guide:
    """One row's matcher."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GuideError(f"the constraint refused token {token}: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """Nothing more may follow (the row ends with "stop")."""
        return bool(self.matcher.is_stopped())


class Guides:
    """The constraints of one tokenizer (and a model's logits width)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf

        self._ll = llguidance
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self.executor = llguidance.LLExecutor()
        self.words = (vocab_size + 31) // 32  # int32 words of a row's bitmask
        self._grammars: OrderedDict[GuideSpec, str] = OrderedDict()

    def grammar(self, spec: GuideSpec) -> str:
        """The spec's grammar, checked; an invalid one is the request's error (400)."""
        if spec in self._grammars:
            self._grammars.move_to_end(spec)
            return self._grammars[spec]
        matcher = self._ll.LLMatcher
        if spec.kind == "json_schema":
            grammar = matcher.grammar_from_json_schema(spec.value, defaults=JSON_OPTIONS)
        elif spec.kind == "regex":
            grammar = matcher.grammar_from_regex(spec.value)
        elif spec.kind == "choice":
            grammar = matcher.grammar_from_lark(_lark_choice(json.loads(spec.value)))
        elif spec.kind == "grammar":
            grammar = matcher.grammar_from_lark(spec.value)
        else:
            raise InvalidRequestError(f"unknown constraint {spec.kind!r}", param="response_format")
        error = matcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise InvalidRequestError(
                f"the {spec.kind.replace('_', ' ')} cannot be used to guide decoding: {error}",
                param="response_format",
                code="invalid_constraint",
            )
        self._grammars[spec] = grammar
        if len(self._grammars) > CACHED_GRAMMARS:
            self._grammars.popitem(last=False)
        return grammar

    def start(self, spec: GuideSpec) -> Guide:
        matcher = self._ll.LLMatcher(self.tokenizer, self.grammar(spec), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(
                f"the constraint cannot start: {matcher.get_error()}", param="response_format"
            )
        return Guide(matcher)

    def masks(self, guides: list[Guide | None]) -> torch.Tensor | None:
        """The allowed tokens of each guided row as a (rows, words) int32 bitmask (unguided
        rows all ones), or None when no row is guided."""
        picked = [(g.matcher, i) for i, g in enumerate(guides) if g is not None]
        if not picked:
            return None
        bitmask = torch.full((len(guides), self.words), -1, dtype=torch.int32)
        self.executor.unsafe_compute_mask_ptr(
            picked, bitmask.data_ptr(), self.words * 4, len(guides)
        )
        return bitmask


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """-inf, in place, for the tokens `bitmask` forbids in `rows` of (batch, vocab) logits (the
    vocabulary beyond the bitmask's width is forbidden too)."""
    if not rows:
        return
    index = torch.tensor(rows)
    words = bitmask[index].to(logits.device)
    index = index.to(logits.device)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:  # (a model's padded vocabulary: never allowed)
        pad = allowed.new_zeros(len(rows), vocab - allowed.shape[1])
        allowed = torch.cat([allowed, pad], dim=1)
    logits[index] = logits[index].masked_fill(~allowed[:, :vocab], float("-inf"))
