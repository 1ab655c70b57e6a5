"""diffusers' lookups around the text encoders answered from the stage's load
(stages/diffusion/encoder_lookups.py) and the absent text's encoding kept (prompt_embeds.py):
a pinned encoder's device from the registry, anything else diffusers' own; an offload hook
refused; the textual-inversion pass skipped only where nothing expands; and a tiny SDXL stage's
images bit for bit those of a stage without either."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import numpy as np
import pytest
import torch

from tests.models.tiny_sdxl import tiny_sdxl_path
from tests.stages.diffusion.lora_helpers import run_images
from vllm_omni_like.config import StageConfig
from vllm_omni_like.models.adapter import adapter_for
from vllm_omni_like.models.registry import family_of
from vllm_omni_like.models.tiny import ensure_tiny_model
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.diffusion import encoder_lookups
from vllm_omni_like.stages.diffusion.encoder_lookups import pin, pinned_device
from vllm_omni_like.stages.diffusion.prompt_embeds import PromptEncoder
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.wire import StageRequest

CPU, META = torch.device("cpu"), torch.device("meta")  # (META: an answer no walk gives)


def _pipe(path: str) -> Any:
    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture
def walks(monkeypatch) -> list[torch.nn.Module]:
    """The modules diffusers' own lookup walks from now on."""
    import diffusers.utils.torch_utils as torch_utils

    seen: list[torch.nn.Module] = []
    walk = torch_utils.get_module_execution_device

    def counted(module: torch.nn.Module) -> torch.device:
        seen.append(module)
        return walk(module)

    monkeypatch.setattr(torch_utils, "get_module_execution_device", counted)
    return seen


def test_pinned_encoders_and_their_compiled_wrappers_are_answered_without_a_walk(walks):
    """Two pipelines of one class pinned to two devices each get their own answer, by the
    pipeline module's lookup, for an encoder and its compiled wrapper alike, walking nothing."""
    first, second = _pipe(tiny_sdxl_path()), _pipe(tiny_sdxl_path())
    assert pin(first, META) == ["text_encoder", "text_encoder_2"]
    assert pin(second, CPU) == ["text_encoder", "text_encoder_2"]
    lookup = sys.modules[type(first).__module__].get_module_execution_device
    assert lookup is pinned_device
    assert lookup(first.text_encoder) == lookup(first.text_encoder_2) == META
    assert lookup(torch.compile(first.text_encoder_2)) == META  # (by its `_orig_mod`)
    assert lookup(second.text_encoder) == CPU
    assert walks == []


def test_any_other_module_gets_diffusers_own_answer(walks):
    """An unpinned pipeline's encoder and the VAE are walked; so is a pinned encoder that got an
    offload hook at its top since (its inputs' device is the hook's)."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    pipe, other = _pipe(tiny_sdxl_path()), _pipe(tiny_sdxl_path())
    pin(pipe, META)
    assert pinned_device(other.text_encoder) == CPU
    assert pinned_device(pipe.vae) == CPU
    assert walks == [other.text_encoder, pipe.vae]
    add_hook_to_module(pipe.text_encoder, AlignDevicesHook(execution_device="cpu"))
    assert pinned_device(pipe.text_encoder) == CPU
    assert walks[-1] is pipe.text_encoder


def test_an_encoder_with_an_offload_hook_is_refused_and_nothing_is_pinned():
    from accelerate.hooks import ModelHook, add_hook_to_module

    pipe = _pipe(tiny_sdxl_path())
    add_hook_to_module(pipe.text_encoder_2.text_model.encoder.layers[1], ModelHook())
    with pytest.raises(RuntimeError) as info:
        pin(pipe, META)
    assert str(info.value) == (
        "text_encoder_2.text_model.encoder.layers.1 has an offload hook: the stage answers a "
        "text encoder's execution device from its load and offloads none through hooks"
    )
    assert pinned_device(pipe.text_encoder) == CPU  # (the first encoder not registered either)
    assert "maybe_convert_prompt" not in vars(pipe)


def test_the_textual_inversion_pass_is_skipped_only_where_nothing_expands():
    """No multi-vector token: the prompt comes back without a tokenizer's pass. A token with a
    second vector (`<cat>`, `<cat>_1`; a single-vector token alone expands to itself): the
    pipeline's own pass, the prompt expanded."""
    prompt = "a <cat> on a mat"
    plain = _pipe(ensure_tiny_model("tiny-image"))
    tokenized: list[str] = []
    tokenize = plain.tokenizer.tokenize
    plain.tokenizer.tokenize = lambda text, **kw: tokenized.append(text) or tokenize(text, **kw)
    plain.tokenizer.add_tokens(["<cat>"])  # (single-vector: nothing to expand)
    assert plain.maybe_convert_prompt([prompt], plain.tokenizer) == [prompt]
    assert tokenized == [prompt]
    pin(plain, CPU)
    assert plain.maybe_convert_prompt([prompt], plain.tokenizer) == [prompt]
    assert tokenized == [prompt]  # (no second pass)

    multi = _pipe(ensure_tiny_model("tiny-image"))
    multi.tokenizer.add_tokens(["<cat>", "<cat>_1"])
    pin(multi, CPU)
    assert multi.maybe_convert_prompt([prompt], multi.tokenizer) == ["a <cat> <cat>_1 on a mat"]


def test_the_absent_text_is_encoded_once_and_only_for_itself():
    """`[None]` (a negative prompt not given) is encoded on first use and kept: equal to a fresh
    encoder's. A batch with another text, an empty negative, a text read with an image, and a
    replaced encoder (compiled: `one_text_a_call`) each encode anew."""
    path = ensure_tiny_model("tiny-image")
    adapter = adapter_for(_pipe(path), family_of(path))
    encoded: list[list[str | None]] = []
    encode = adapter.encode_text

    def counted(texts: list[str | None], device: torch.device, max_length: int) -> Any:
        encoded.append(list(texts))
        return encode(texts, device, max_length)

    adapter.encode_text = counted  # (counting its calls)
    tokenizer = adapter.pipe.tokenizer
    text = PromptEncoder(adapter, CPU, tokenizer, None, torch.float32)
    with torch.inference_mode():
        kept, again = text([None]), text([None])
        pair, empty = text([None, "x"]), text([""])
        with pytest.raises(NotImplementedError):  # (SD's text reads no image: not the kept)
            text([None], [None])
        one_a_call = dataclasses.replace(text, one_text_a_call=True)([None])
        fresh = PromptEncoder(adapter, CPU, tokenizer, None, torch.float32)([None])
    assert again is kept
    assert encoded == [[None], [None, "x"], [""], [None], [None]]
    assert torch.equal(fresh, kept) and torch.equal(one_a_call, kept)
    assert torch.equal(empty, kept)  # (SD's absent text is the empty one, encoded)
    torch.testing.assert_close(pair[:1], kept)


def _stage(model: str) -> DiffusionStage:
    config = StageConfig(name="diffusion", kind="diffusion", model=model, dtype="float32")
    stage = DiffusionStage(config)
    stage.load("cpu")
    return stage


def _requests() -> list[StageRequest]:
    """No negative (the absent text), a negative, no guidance; the first again, the absent
    text kept by then."""
    params = [{}, {"negative_prompt": "blurry"}, {"guidance_scale": 1.0}, {}]
    return [
        StageRequest(
            f"r{i}",
            "a red circle",
            GenerationParams(seed=i, num_inference_steps=3, **({"guidance_scale": 5.0} | p)),
            mode="text2img",
        )
        for i, p in enumerate(params)
    ]


def _run(stage: DiffusionStage) -> tuple[list[dict[str, np.ndarray]], int, bool]:
    """Each request's images, run one at a time; the walks of the text encoders' modules
    (`.modules()`: diffusers' lookup calls it twice) they made; whether the absent text was
    kept. The stage is closed after."""
    walked = [0]
    for _, encoder in encoder_lookups.text_encoders(stage.runtime.pipe):
        modules = encoder.modules
        encoder.modules = lambda modules=modules: walked.__setitem__(0, walked[0] + 1) or modules()
    try:
        images = [run_images(stage, [r]) for r in _requests()]
        return images, walked[0], "_absent" in vars(stage.runtime.text)
    finally:
        stage.close()


@pytest.fixture
def one_thread():
    """One torch thread: on two shared cores OpenMP's threads wait on each other (a tiny
    SDXL request 9.5 s with two, 0.12 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_stage_makes_the_same_images_bit_for_bit(monkeypatch, one_thread):
    """A tiny SDXL stage (two CLIPs, diffusers' lookups and textual-inversion pass in its
    `encode_prompt`) against one loaded without `pin` and without the kept absent text: equal
    pixels, request by request; the pinned stage walked no text encoder's modules."""
    with monkeypatch.context() as plain:
        plain.setattr(encoder_lookups, "pin", lambda pipe, device: [])
        plain.setattr(PromptEncoder, "__call__", PromptEncoder._encode)
        want, walked, kept = _run(_stage(tiny_sdxl_path()))
    assert walked == 7 * 2 * 2 and not kept  # (7 texts encoded, 2 encoders, 2 walks each)
    stage = _stage(tiny_sdxl_path())
    lookup = sys.modules[type(stage.runtime.pipe).__module__].get_module_execution_device
    assert lookup is pinned_device
    got, walked, kept = _run(stage)
    assert walked == 0 and kept
    for a, b in zip(want, got, strict=True):
        assert a.keys() == b.keys()
        for rid in a:
            np.testing.assert_array_equal(a[rid], b[rid])
