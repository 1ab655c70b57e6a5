"""The LLM stage's own decode loop: one forward per step for the whole batch (a KV cache), each
row sampled with its own settings, its own generator and its own constraint.

Rows of different lengths, token budgets and sampling settings share every forward; what a
row draws depends on its own logits, its own seeded generator and its own constraint only, so it
equals the row's solo run. A finished row stays in the batch (its cache must keep the batch's
shape) fed a pad token under a zero attention mask, and its output is final.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_omni_like.outputs import TextDelta
from vllm_omni_like.stages.guided import Guides, apply_masks
from vllm_omni_like.stages.sampling import RowSampling, choose, penalize, token_logprobs

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


class DecodeLoop:
    """Batched greedy/sampled decoding over a causal LM's forward with a KV cache."""

    def __init__(
        self, model: torch.nn.Module, tokenizer, device: torch.device, guides: Guides | None
    ) -> None:
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.guides = guides
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos
        # the KV cache's keyword: `cache` in recent transformers, `past_key_values` before
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.extra = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    def run(
        self,
        prompts: list[list[int]],
        rows: list[RowSampling],
        on_step: Callable[[int, int, dict[int, TextDelta]], None] = lambda s, t, d: None,
        row_fault: Callable[[str, int], None] = lambda point, row: None,
        on_done: Callable[[int, RowResult], None] = lambda row, result: None,
    ) -> list[RowResult]:
        """Decode every row; `on_step(step, total, deltas)` after each step, with the new text
        of the rows that stream (it may raise to stop the batch). `row_fault(point, i)` runs
        before row i's constraint follows its token ("constraint") and before its text is
        decoded ("detokenize"): a row whose step raises there ends alone with that error.
        `on_done(i, result)` as soon as row i ends (its output may go out before the batch's)."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        ids, mask = ids.to(self.device), mask.to(self.device)
        results = [
            RowResult(prompt_tokens=len(p), logprobs=[] if r.logprobs else None)
            for p, r in zip(prompts, rows, strict=True)
        ]
        gens = [
            torch.Generator().manual_seed(r.seed or 0) if r.temperature > 0 else None for r in rows
        ]
        done = [r.max_new_tokens <= 0 for r in rows]
        wants_raw = any(r.logprobs for r in rows)
        total = max(r.max_new_tokens for r in rows)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = None
        step = 0
        with torch.inference_mode():
            while not all(done):
                out = self.model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=positions,
                    use_cache=True,
                    **{self.cache_arg: cache},
                    **self.extra,
                )
                cache, raw = getattr(out, self.cache_arg), out.logits[:, -1].float()
                # penalties and constraints change the logits in place: the raw ones are kept
                # apart only while a row reports log-probabilities (the model's own)
                logits = raw.clone() if wants_raw else raw
                self._constrain(logits, rows, done)
                step += 1
                nxt, deltas, ended = [], {}, []
                for i, row in enumerate(rows):
                    if done[i]:
                        nxt.append(self.pad)
                        continue
                    res = results[i]
                    penalize(logits[i], row, prompts[i] + res.token_ids, res.token_ids)
                    token = choose(logits[i], row, gens[i])
                    nxt.append(token)
                    try:
                        done[i] = self._take(res, row, token, raw[i], row_fault, i)
                    except Exception as exc:  # this row's alone: its peers run on
                        res.error, done[i] = exc, True
                    if row.stream and res.error is None:
                        deltas[i] = self._delta(res, row, done[i])
                    if done[i]:
                        ended.append(i)
                live = torch.tensor([[0 if d else 1] for d in done])
                ids = torch.tensor(nxt, device=self.device)[:, None]
                mask = torch.cat([mask, live.to(self.device)], dim=1)
                positions = positions[:, -1:] + 1
                on_step(step, total, deltas)  # (a streamed row's last text first)
                for i in ended:
                    on_done(i, results[i])
        return results

    def _constrain(self, logits: torch.Tensor, rows: list[RowSampling], done: list[bool]) -> None:
        """-inf for what each constrained row's grammar forbids next."""
        if self.guides is None:
            return
        guides = [None if done[i] else r.guide for i, r in enumerate(rows)]
        bitmask = self.guides.masks(guides)
        if bitmask is not None:
            apply_masks(logits, bitmask, [i for i, g in enumerate(guides) if g is not None])

    def _take(
        self,
        res: RowResult,
        row: RowSampling,
        token: int,
        raw: torch.Tensor,
        row_fault: Callable[[str, int], None],
        i: int,
    ) -> bool:
        """Add `token` to the row; whether the row is finished. The text is decoded at every
        step only for a row with stop strings to look for or that streams; otherwise once, when
        it ends."""
        res.generated += 1
        if row.guide is not None:
            row_fault("constraint", i)
            row.guide.consume(token)
        row_fault("detokenize", i)
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

    def _delta(self, res: RowResult, row: RowSampling, finished: bool) -> TextDelta:
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
