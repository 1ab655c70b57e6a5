"""One forward a step for every LLM row that steps, over a KV cache the rows join and leave.

The LLM stage's running set of rows, its cache cut by rows in kv_rows.py.

A row joins with its prompt's cache (all but its last token, prefilled with the rows that join
with it) and feeds its last prompt token at its first step, so every step is one token a row.
What a row draws depends on its own logits, its own seeded generator and its own constraint
only (token_rules.py), so it equals its solo run whether it ran alone or joined at step k. A
row that does not step (ended, or outside a bisection's `only`) feeds a pad under a zero mask:
its cache and position are unchanged. A step that raises before its commit changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vllm_omni_like.outputs import TextDelta
from vllm_omni_like.stages.llm import kv_rows
from vllm_omni_like.stages.llm.sampling import RowSampling, choose, penalize
from vllm_omni_like.stages.llm.token_rules import RowDecoder, RowResult


@dataclass
class Row:
    key: str
    prompt: list[int]
    sampling: RowSampling
    result: RowResult
    generator: torch.Generator | None
    token: int  # what it feeds at its next step
    position: int  # that token's position
    done: bool = False

    @property
    def progress(self) -> tuple[int, int]:
        return self.result.generated, self.sampling.max_new_tokens


@dataclass
class Stepped:
    """What a step did: each stepped row's (tokens, budget), the rows that ended and the
    deltas of those that stream."""

    progress: dict[str, tuple[int, int]]
    ended: list[str]
    deltas: dict[str, TextDelta]


class DecodeSet:
    def __init__(self, model: torch.nn.Module, decoder: RowDecoder, device: torch.device) -> None:
        self.model, self.decoder, self.device = model, decoder, device
        self.rows: list[Row] = []
        self.layers: kv_rows.Layers | None = None
        self.mask = torch.zeros((0, 0), dtype=torch.long, device=device)

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, layers):
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self.decoder.cache_arg: kv_rows.lend(layers)},
            **self.decoder.extra,
        )
        return kv_rows.taken(getattr(out, self.decoder.cache_arg)), out.logits[:, -1].float()

    def join(self, entries: list[tuple[str, list[int], RowSampling]]) -> None:
        """Rows (key, prompt tokens, settings) join: their prompts but the last token prefilled
        together. All or none."""
        pad = self.decoder.pad
        heads = [prompt[:-1] for _, prompt, _ in entries]
        width = max(len(h) for h in heads)
        mask = torch.tensor([[0] * (width - len(h)) + [1] * len(h) for h in heads])
        mask = mask.to(self.device).reshape(len(entries), width)
        layers = None
        if width:
            ids = torch.tensor([[pad] * (width - len(h)) + h for h in heads], device=self.device)
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            with torch.inference_mode():
                layers, _ = self._forward(ids, mask, positions, None)
        rows = [
            Row(
                key,
                prompt,
                row,
                RowResult(prompt_tokens=len(prompt), logprobs=[] if row.logprobs else None),
                torch.Generator().manual_seed(row.seed or 0) if row.temperature > 0 else None,
                prompt[-1],
                len(prompt) - 1,
                done=row.max_new_tokens <= 0,
            )
            for key, prompt, row in entries
        ]
        self.layers, self.mask = kv_rows.merge(self.layers, self.mask, layers, mask)
        self.rows += rows

    def step(
        self,
        live: set[str],
        check: Callable[[list[str]], None],
        fault: Callable[[str, str], None],
        only: set[str] | None = None,
    ) -> Stepped | None:
        """One token for each live row that has not ended (of `only`); None if none steps.
        `check(keys)` runs before anything is committed (it may raise: nothing changed);
        `fault(point, key)` at a row's per-row points (a row that raises there ends alone)."""
        stepping = [
            i
            for i, r in enumerate(self.rows)
            if not r.done and r.key in live and (only is None or r.key in only)
        ]
        if not stepping:
            return None
        check([self.rows[i].key for i in stepping])
        on = set(stepping)
        col = torch.tensor([[1 if i in on else 0] for i in range(len(self.rows))])
        mask = torch.cat([self.mask, col.to(self.device)], dim=1)
        pad = self.decoder.pad
        ids = torch.tensor([[r.token if i in on else pad] for i, r in enumerate(self.rows)])
        positions = torch.tensor([[r.position] for r in self.rows])
        with torch.inference_mode():
            layers, raw = self._forward(
                ids.to(self.device), mask, positions.to(self.device), self.layers
            )
            wants_raw = any(self.rows[i].sampling.logprobs for i in stepping)
            logits = raw.clone() if wants_raw else raw
            guides = [r.sampling.guide if i in on else None for i, r in enumerate(self.rows)]
            self.decoder.constrain(logits, guides)
        self.layers, self.mask = layers, mask  # committed: from here each row is its own
        done = Stepped({}, [], {})
        for i in stepping:
            row = self.rows[i]
            self._take(row, logits[i], raw[i], fault, done)
        return done

    def _take(
        self,
        row: Row,
        logits: torch.Tensor,
        raw: torch.Tensor,
        fault: Callable[[str, str], None],
        done: Stepped,
    ) -> None:
        res, sampling = row.result, row.sampling
        try:
            penalize(logits, sampling, row.prompt + res.token_ids, res.token_ids)
            token = choose(logits, sampling, row.generator)
            row.token, row.position = token, row.position + 1
            row.done = self.decoder.take(res, sampling, token, raw, lambda p: fault(p, row.key))
        except Exception as exc:  # this row's alone: its peers run on
            res.error, row.done = exc, True
        if sampling.stream and res.error is None:
            done.deltas[row.key] = self.decoder.delta(res, sampling, row.done)
        done.progress[row.key] = row.progress
        if row.done:
            done.ended.append(row.key)

    def leave(self, live: set[str]) -> list[tuple[str, RowResult]]:
        """The rows that ended, out of the set (in set order); rows not `live` dropped."""
        ended = [(r.key, r.result) for r in self.rows if r.done and r.key in live]
        self._keep([i for i, r in enumerate(self.rows) if not r.done and r.key in live])
        return ended

    def remove(self, keys: set[str]) -> None:
        self._keep([i for i, r in enumerate(self.rows) if r.key not in keys])

    def _keep(self, rows: list[int]) -> None:
        if len(rows) == len(self.rows):
            return
        self.layers, self.mask = kv_rows.keep(self.layers, self.mask, rows)
        self.rows = [self.rows[i] for i in rows]

    @property
    def keys(self) -> list[str]:
        return [r.key for r in self.rows]
