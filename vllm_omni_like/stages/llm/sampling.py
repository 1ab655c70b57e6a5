"""One LLM row's sampling: its settings, penalties and the choice of its next token.

With the log-probabilities a client may ask for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    logprobs: bool = False  # each output token's log-probability
    top_logprobs: int = 0  # and the most likely tokens' at each position
    stream: bool = False  # hand out the new text at every step
    guide: Any = None  # stages/llm/guided.py's Guide: the tokens its constraint allows


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


def token_logprobs(raw: torch.Tensor, token: int, top: int, piece: Any) -> dict[str, Any]:
    """OpenAI's logprobs entry of `token` from the model's raw (vocab,) logits (before
    penalties, temperature and constraints): its log-probability and the `top` likeliest;
    `piece(id)` gives a token's text and bytes."""
    logp = torch.log_softmax(raw, dim=-1)
    text, data = piece(token)
    entry: dict[str, Any] = {
        "token": text,
        "logprob": max(float(logp[token]), -9999.0),
        "bytes": data,
        "top_logprobs": [],
    }
    if top > 0:
        values, ids = logp.topk(min(top, logp.numel()))
        for value, other in zip(values.tolist(), ids.tolist(), strict=True):
            other_text, other_data = piece(other)
            entry["top_logprobs"].append(
                {"token": other_text, "logprob": max(value, -9999.0), "bytes": other_data}
            )
    return entry
