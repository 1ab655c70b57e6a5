"""The LLM stage's own decode loop: one forward per step for the whole batch (a KV cache), each
row sampled with its own settings and its own generator.

Rows of different lengths, token budgets and sampling settings share every forward; what a
row draws depends on its own logits and its own seeded generator only, so it equals the row's
solo run. A finished row stays in the batch (its cache must keep the batch's shape) fed a pad
token under a zero attention mask, and its output is final.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class RowSampling:
    """One row's settings (OpenAI's names where it has them)."""

    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    repetition_penalty: float = 1.0  # HF's: over the prompt and the output
    presence_penalty: float = 0.0  # OpenAI's: over the output
    frequency_penalty: float = 0.0


@dataclass
class RowResult:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"  # "stop" (end of sequence or a stop string) or "length"
    prompt_tokens: int = 0
    error: Exception | None = None  # this row failed alone (its peers ran on)


def penalize(logits: torch.Tensor, row: RowSampling, seen: list[int], out: list[int]) -> None:
    """The row's penalties, in place on its (vocab,) float logits."""
    if row.repetition_penalty != 1.0 and seen:
        ids = torch.tensor(sorted(set(seen)), device=logits.device)
        picked = logits[ids]
        logits[ids] = torch.where(
            picked > 0, picked / row.repetition_penalty, picked * row.repetition_penalty
        )
    if (row.presence_penalty or row.frequency_penalty) and out:
        ids, counts = torch.tensor(out, device=logits.device).unique(return_counts=True)
        logits[ids] -= row.presence_penalty + row.frequency_penalty * counts.to(logits.dtype)


def choose(logits: torch.Tensor, row: RowSampling, generator: torch.Generator | None) -> int:
    """The next token from the row's penalized (vocab,) float logits."""
    if row.temperature <= 0 or generator is None:
        return int(logits.argmax())
    scaled = logits / row.temperature
    if 0 < row.top_k < scaled.numel():
        kth = scaled.topk(row.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if row.top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        drop = sorted_p.cumsum(0) - sorted_p > row.top_p
        probs[order[drop]] = 0.0
        probs = probs / probs.sum()
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


class DecodeLoop:
    """Batched greedy/sampled decoding over a causal LM's forward with a KV cache."""

    def __init__(self, model: torch.nn.Module, tokenizer, device: torch.device) -> None:
        self.model, self.tokenizer, self.device = model, tokenizer, device
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
        on_step: Callable[[int, int], None] = lambda step, total: None,
        before_detokenize: Callable[[int], None] = lambda row: None,
    ) -> list[RowResult]:
        """Decode every row; `on_step(step, total)` after each step (it may raise to stop the
        batch). A row whose detokenization raises (`before_detokenize(i)` runs first: a fault
        point) ends alone with that error; the others run on."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        ids, mask = ids.to(self.device), mask.to(self.device)
        results = [RowResult(prompt_tokens=len(p)) for p in prompts]
        gens = [
            torch.Generator().manual_seed(r.seed or 0) if r.temperature > 0 else None for r in rows
        ]
        done = [r.max_new_tokens <= 0 for r in rows]
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
                cache, logits = getattr(out, self.cache_arg), out.logits[:, -1].float()
                step += 1
                nxt = []
                for i, row in enumerate(rows):
                    if done[i]:
                        nxt.append(self.pad)
                        continue
                    res = results[i]
                    penalize(logits[i], row, prompts[i] + res.token_ids, res.token_ids)
                    token = choose(logits[i], row, gens[i])
                    nxt.append(token)
                    try:
                        before_detokenize(i)
                        done[i] = self._advance(res, row, token)
                    except Exception as exc:  # this row's alone: its peers run on
                        res.error, done[i] = exc, True
                live = torch.tensor([[0 if d else 1] for d in done])
                ids = torch.tensor(nxt, device=self.device)[:, None]
                mask = torch.cat([mask, live.to(self.device)], dim=1)
                positions = positions[:, -1:] + 1
                on_step(step, total)
        return results

    def _advance(self, res: RowResult, row: RowSampling, token: int) -> bool:
        """Add `token` to the row; whether the row is finished. The text is decoded at every
        step only for a row with stop strings to look for; otherwise once, when it ends."""
        if token == self.eos:
            res.finish_reason = "stop"
            res.text = self._decode(res.token_ids)
            return True
        res.token_ids.append(token)
        if row.stop:
            res.text = self._decode(res.token_ids)
            for stop in row.stop:
                at = res.text.find(stop)
                if at >= 0:
                    res.text, res.finish_reason = res.text[:at], "stop"
                    return True
        if len(res.token_ids) >= row.max_new_tokens:
            res.text = self._decode(res.token_ids)
            return True
        return False

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
