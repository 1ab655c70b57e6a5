"""A diffusion stage for the sequence-parallel tests, imported by 'module:Class' in its workers
(or made in the test's own process for the one-rank reference). It writes what a test compares
into the directory $SEQUENCE_PROBE_DIR: rank 0 each request's final latents, before the VAE
(`<request id>.pt`, float32); every rank the tokens its denoisers' first block took in each
forward (`tokens-rank<r>.txt`, one count a line) and, where it holds a VAE, the rows its
decoder made in each call (`decoded-rank<r>.txt`)."""

from __future__ import annotations

import os
from typing import Any

import torch

from vllm_omni_like.stages.diffusion.stage import DiffusionStage

PROBE_ENV = "SEQUENCE_PROBE_DIR"


def first_block(model: Any) -> Any:
    """The first block of a Wan transformer (`blocks`), an MMDiT's (FLUX.1, Qwen-Image, SD3:
    `transformer_blocks`), or Z-Image's first main layer (`layers`: the unified sequence)."""
    for name in ("blocks", "transformer_blocks", "layers"):
        blocks = getattr(model, name, None)
        if blocks is not None:  # (a block compiled alone: its own module, where the split is)
            return getattr(blocks[0], "_orig_mod", blocks[0])
    raise AttributeError(f"{type(model).__name__} has no blocks the probe knows")


class SequenceProbeStage(DiffusionStage):
    def load(self, device: str) -> None:
        super().load(device)
        where = os.environ[PROBE_ENV]
        rt = self.runtime
        models = (
            rt.seq_ranks.models
            if rt.seq_ranks is not None
            else {e.name: e.model for e in rt.adapter.experts()}
        )
        counts = os.path.join(where, f"tokens-rank{self.ranks.rank}.txt")

        def count(module: Any, args: tuple, kwargs: dict) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            with open(counts, "a") as f:
                f.write(f"{hidden.shape[1]}\n")

        for name, model in models.items():
            if name.endswith(".decode"):  # (a patch-parallel VAE's decode)
                continue
            inner = getattr(model, "_orig_mod", model)  # (a compiled one's own)
            first_block(inner).register_forward_pre_hook(count, with_kwargs=True)
        decoded = os.path.join(where, f"decoded-rank{self.ranks.rank}.txt")

        def rows(module: Any, args: tuple, out: Any) -> None:
            with open(decoded, "a") as f:
                f.write(f"{out.shape[-2]}\n")

        vae = getattr(rt.pipe, "vae", None)
        if vae is not None:
            vae.decoder.register_forward_hook(rows)
        if self.ranks.rank == 0:
            keep_latents(rt, where)


def keep_latents(rt: Any, where: str) -> None:
    """Rank 0 (or one rank): each request's final latents, before the VAE, to
    `<where>/<request id>.pt` (float32)."""
    defer = rt.defer

    def keep(batch, media, seeds, frames, decoder):  # type: ignore[no-untyped-def]
        row = 0
        for r in batch:
            rows = rt.rows_of(r)
            path = os.path.join(where, f"{r.request_id}.pt")
            torch.save(media[row : row + rows].float().cpu().clone(), path)
            row += rows
        return defer(batch, media, seeds, frames, decoder)

    rt.defer = keep
