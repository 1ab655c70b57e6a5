"""Which of a family's text encoders `--compile-text-encoders` compiles (the adapter's
`text_encoder_targets`): the pipeline's `text_encoder*` components by default, each called
by our loop with one text at a time (stages/diffusion/prompt_embeds.py) at a token length its
tokenizer fixes, so each is one graph, run by the compile warm-up; a family whose encoder sees
a length of each prompt's own (Qwen-Image's Qwen2.5-VL) names none.

Eager HF text encoders run a few hundred small kernels, each launched from Python: on a fast
GPU a join (a request's text encoders, its latents) is host-bound, the device idle
(bench/README.md, "the join's host time")."""

from __future__ import annotations

from typing import Any

TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")  # diffusers' names


class TextEncoders:
    """The adapter's side of compiling the text encoders."""

    pipe: Any
    # compile each encoder's repeated blocks (one graph a kind of block and a length, its
    # blocks sharing it) rather than the encoder whole (one graph of every layer a length): for
    # an encoder read at several lengths, each a compile of its own at every start
    text_encoders_by_block = False

    def text_encoder_targets(self) -> list[tuple[Any, str]]:
        """(owner, attribute) of each text encoder to compile: those of the pipeline's
        `text_encoder*` components it has (a dummy's left-out encoders are None)."""
        return [(self.pipe, n) for n in TEXT_ENCODERS if getattr(self.pipe, n, None) is not None]
