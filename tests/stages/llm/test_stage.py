"""The LLM stage serves a user's local causal LM (`--llm DIR`): tiny random Llama and Qwen2
models built here, offline, in front of the embedded image model, through the real engine."""

from __future__ import annotations

import asyncio

import pytest

from tests.engine.helpers import final
from vllm_omni_like.config import EngineConfig
from vllm_omni_like.engine import AsyncOmni
from vllm_omni_like.inputs import OmniRequest
from vllm_omni_like.models.tiny import ensure_tiny_model
from vllm_omni_like.models.tiny_llm import build_llm_tokenizer
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.pipelines.catalog import resolve

pytestmark = pytest.mark.slow


def _build(kind: str, out: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    tok = build_llm_tokenizer(["a red circle on a blue background", "draw a green square"], 300)
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[kind]
    config = config_cls(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model_cls(config).save_pretrained(out)
    tok.save_pretrained(out)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_local_causal_lm_rewrites_the_prompt_in_front_of_the_image_model(tmp_path, kind):
    _build(kind, str(tmp_path / kind))
    (pipeline,) = resolve(ensure_tiny_model("tiny-image"), llm=str(tmp_path / kind))
    assert [s.kind for s in pipeline.stages] == ["llm", "diffusion"]
    eng = AsyncOmni(EngineConfig(pipelines=(pipeline,)))
    eng.start()
    try:
        params = GenerationParams(seed=3, num_inference_steps=2, max_new_tokens=6)
        outs = [
            asyncio.run(final(eng, OmniRequest(f"{kind}{i}", "red circle", pipeline.name, params)))
            for i in range(2)
        ]
    finally:
        eng.shutdown()
    for out in outs:
        assert out.ok, out.error
        assert isinstance(out.revised_prompt, str)  # random weights: some text, its own
        assert out.output.images[0].pixels.shape == (64, 64, 3)
    assert outs[0].revised_prompt == outs[1].revised_prompt  # greedy: the same text twice
