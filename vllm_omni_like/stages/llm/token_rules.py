"""What a sampled token does to its LLM row: its constraint, stop strings, budget and text.

The LLM stage's token rules, one row at a time: what a sampled token does to its row (its
constraint, stop strings, budget, text and log-probabilities) and what a streamed row hands out.
`DecodeSet` (token_batch.py) steps the rows; this decides each row's fate from its own logits,
its own seeded generator and its own constraint only, so a row equals its solo run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_omni_like.outputs import TextDelta
from vllm_omni_like.stages.llm.guided import Guides, apply_masks
from vllm_omni_like.stages.llm.sampling import RowSampling, token_logprobs

REPLACEMENT = "\ufffd"  # a character whose bytes have not all been decoded yet


@dataclass
class RowResult:
    token_ids: list[int] = field(default_factory=list)  # the output's (no end of sequence)
    text: str = ""
    finish_reason: str = "length"  # "stop" (end of sequence, a stop string, a complete
    # constraint) or "length"
    prompt_tokens: int = 0
    generated: int = 0  # tokens sampled, an end of sequence included (usage)
    logprobs: list[dict[str, Any]] | None = None
    error: Exception | None = None  # this row failed alone (its peers ran on)
    sent: int = 0  # characters of `text` handed out as deltas (streamed rows)
    sent_tokens: int = 0


class RowDecoder:
    """A tokenizer's end of sequence and pad, a model's KV-cache keyword, and the rules above."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, guides: Guides | None) -> None:
        import inspect

        self.tokenizer, self.guides = tokenizer, guides
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos
        # the KV cache's keyword: `cache` in recent transformers, `past_key_values` before
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    def constrain(self, logits: torch.Tensor, guides: list[Any]) -> None:
        """-inf for what each constrained row's grammar forbids next (`guides`: each row's
        constraint, None for a row without one or that does not step)."""
        if self.guides is None:
            return
        bitmask = self.guides.masks(guides)
        if bitmask is not None:
            apply_masks(logits, bitmask, [i for i, g in enumerate(guides) if g is not None])

    def take(
        self,
        res: RowResult,
        row: RowSampling,
        token: int,
        raw: torch.Tensor,
        fault: Callable[[str], None],
    ) -> bool:
        """Add `token` to the row; whether the row is finished. `fault(point)` runs before the
        row's constraint follows the token ("constraint") and before its text is decoded
        ("detokenize"). The text is decoded at every step only for a row with stop strings to
        look for or that streams; otherwise once, when it ends."""
        res.generated += 1
        if row.guide is not None:
            fault("constraint")
            row.guide.consume(token)
        fault("detokenize")
        if token == self.eos:
            res.finish_reason = "stop"
            res.text = self._decode(res.token_ids)
            return True
        res.token_ids.append(token)
        if res.logprobs is not None:
            res.logprobs.append(token_logprobs(raw, token, row.top_logprobs, self._piece))
        if row.stop or row.stream:
            res.text = self._decode(res.token_ids)
            for stop in row.stop:
                at = res.text.find(stop)
                if at >= 0:
                    res.text, res.finish_reason = res.text[:at], "stop"
                    return True
        if row.guide is not None and row.guide.complete:
            res.text, res.finish_reason = self._decode(res.token_ids), "stop"
            return True
        if len(res.token_ids) >= row.max_new_tokens:
            res.text = self._decode(res.token_ids)
            return True
        return False

    def delta(self, res: RowResult, row: RowSampling, finished: bool) -> TextDelta:
        """The row's text and tokens since its last delta. Until it ends, text that may still
        change is held back: a character not yet whole, or the start of a stop string."""
        text = res.text
        if not finished:
            keep = len(text)
            if text.endswith(REPLACEMENT):
                keep = len(text.rstrip(REPLACEMENT))
            for stop in row.stop:
                for n in range(min(len(stop) - 1, keep), 0, -1):
                    if text[:keep].endswith(stop[:n]):
                        keep -= n
                        break
            text = text[:keep]
        new = text[res.sent :] if len(text) > res.sent else ""
        res.sent = max(res.sent, len(text))
        tokens = res.token_ids[res.sent_tokens :]
        logprobs = res.logprobs[res.sent_tokens :] if res.logprobs is not None else None
        res.sent_tokens = len(res.token_ids)
        return TextDelta(new, tokens, logprobs)

    def _piece(self, token: int) -> tuple[str, list[int]]:
        """A token's text and its exact bytes (a byte-level BPE token may be part of a
        character: its text then holds a replacement character, its bytes are exact)."""
        data = (
            self.guides.tokenizer.decode_bytes([token])
            if self.guides is not None
            else self.tokenizer.decode([token]).encode()
        )
        return data.decode("utf-8", errors="replace"), list(data)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
