"""The embedded rewriter's architecture and tokenizer (`tiny-llm`), built offline.

A byte-level BPE tokenizer (the `tokenizers` library, the scheme of GPT-2, Llama 3 and Qwen2):
a word it never saw splits into known pieces, down to single bytes, instead of collapsing into
one unknown token, so an unseen word is something the model reads (and learns to ignore), not a
hole in its input. Cased, no normaliser: casing is the model's to learn.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm_omni_like.shapes.world import OUTSIDE

SPECIALS = ["<pad>", "<s>", "</s>", "<sep>"]
MAX_POSITIONS = 160


def build_llm_tokenizer(corpus: Iterable[str], vocab_size: int = 1024) -> Any:
    """A byte-level BPE tokenizer trained on `corpus` (deterministic for a given corpus)."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens([AddedToken(OUTSIDE, normalized=False)])  # decoded like any other word
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        sep_token="<sep>",
        model_max_length=MAX_POSITIONS,
        padding_side="left",
    )


def llm_model(tokenizer: Any, hidden: int = 192, layers: int = 4) -> Any:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 8 * 8,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 32,
        num_key_value_heads=hidden // 32,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        max_new_tokens=24,
        do_sample=False,
    )
    return model


def build_llm(out: str) -> None:
    """Random weights (what runs when no trained rewriter ships): the tokenizer learns its
    pieces from the world's captions."""
    import torch

    from vllm_omni_like.shapes import world

    captions = [
        world.Scene(shape, colour, position, background, size).caption()
        for shape in world.SHAPES
        for colour in world.COLOURS
        for background in world.COLOURS
        for position in world.POSITIONS
        for size in world.SIZES
        if colour != background
    ]
    tokenizer = build_llm_tokenizer([*captions, world.describe()])
    torch.manual_seed(0)
    llm_model(tokenizer).save_pretrained(out)
    tokenizer.save_pretrained(out)
