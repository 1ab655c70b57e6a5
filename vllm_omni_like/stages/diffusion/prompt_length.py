"""Prompts against the text encoder's limit: refused when a client wrote them, else truncated."""

from __future__ import annotations

import logging
from typing import Any

from vllm_omni_like.errors import InvalidRequestError
from vllm_omni_like.wire import StageRequest

logger = logging.getLogger(__name__)


def check_prompt_length(tokenizer: Any, request: StageRequest, stage: str) -> None:
    """400 `prompt_too_long` for a client's prompt the encoder would cut (an earlier stage's
    prompt, `truncate_prompt`, is truncated instead)."""
    if tokenizer is None or request.truncate_prompt:
        return
    limit = tokenizer.model_max_length
    for text, param in (
        (request.prompt, "prompt"),
        (request.params.negative_prompt or "", "negative_prompt"),
    ):
        count = len(tokenizer(text).input_ids)
        if count > limit:
            raise InvalidRequestError(
                f"{param} is {count} tokens long; the text encoder takes at most {limit}",
                stage=stage,
                param=param,
                code="prompt_too_long",
            )


def truncate_prompt(tokenizer: Any, text: str, stage: str) -> str:
    """`text` cut to what the encoder takes, special tokens included."""
    limit = tokenizer.model_max_length
    ids = tokenizer(text, add_special_tokens=False).input_ids
    special = len(tokenizer("").input_ids)
    if len(ids) + special <= limit:
        return text
    logger.warning(
        "stage %s: prompt of %d tokens truncated to %d", stage, len(ids) + special, limit
    )
    return tokenizer.decode(ids[: limit - special])
