"""The chat-shaped tokenizer the Qwen-Image and Z-Image architectures ship (synthesized
offline: nothing is downloaded), torch-free."""

from __future__ import annotations

from typing import Any

from vllm_omni_like.models.tiny import SPECIALS, vocabulary

CHAT_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
# Qwen2.5-VL's: an image's place in a text (the processor repeats the pad once per merged patch)
VISION_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# Qwen3's chat template for what the pipelines ask of it: messages, the assistant's turn, and
# an empty thought where thinking is off (Z-Image encodes "user: <prompt>" with thinking on)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
# the words of the Qwen-Image pipelines' chat templates
CHAT_WORDS = "system user assistant describe by detailing color size texture quantity text spatial"
CHAT_WORDS += " relationships objects"
# ... and of Qwen-Image-Edit's
CHAT_WORDS += " key features input ( ), then explain how 's instruction should alter or modify"
CHAT_WORDS += " generate new that meets requirements while maintaining consistency original where"
CHAT_WORDS += " appropriate"
# words, a contraction ('s), digits, and runs of punctuation ("),") are a token each, as
# Qwen2's pre-tokenizer splits them
PIECES = r"'(?:s|t|re|ve|m|ll|d)|[^\W\d_]+|\d|[^\s\w]+"


def build_chat_tokenizer(max_length: int = 1024) -> Any:
    """A word-level tokenizer in the shape of Qwen2's (and Qwen3's) chat tokenizer, for the
    Qwen-Image and Z-Image architectures (with Qwen3's chat template): `<|im_start|>`,
    `<|im_end|>` and each line break are tokens of their own, words
    and runs of punctuation one token each (`PIECES`; unknown ones `<unk>`), no BOS or EOS,
    padding with `<|endoftext|>` on the right; Qwen2.5-VL's vision tokens. The pipelines cut
    a fixed count of tokens off the front of their chat template (QwenImagePipeline: 34,
    QwenImageEditPipeline: 64, the length of its system prompt under Qwen2's tokenizer); this
    one makes those prefixes the same 34 and 64 tokens (tests/models/test_qwen_image*.py).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = (*CHAT_SPECIALS, *VISION_SPECIALS)
    words = [*specials, "<unk>", *vocabulary()[len(SPECIALS) :], *CHAT_WORDS.split()]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(words))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(PIECES), "isolated")]
    )
    tok.add_special_tokens([AddedToken(t, normalized=False) for t in specials])
    tok.add_tokens([AddedToken("\n", normalized=False)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        model_max_length=max_length,
        padding_side="right",
        chat_template=CHAT_TEMPLATE,
    )
