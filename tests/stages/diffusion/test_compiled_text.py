"""Compiled text encoders (`--compile-text-encoders`) on the CPU: each family's compiled
encoders give its eager embeddings, one text a call, so a join of any count of texts runs the
warm-up's graphs (dynamo's counters); a compiled stage's warm-up covers them; the flag's
choices and refusals."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
import torch

from vllm_omni_like.compile_choices import text_encoders_compiled
from vllm_omni_like.config import StageConfig
from vllm_omni_like.errors import ConfigError
from vllm_omni_like.models.adapter import Adapter, adapter_for
from vllm_omni_like.models.registry import family_of
from vllm_omni_like.stages.diffusion import acceleration as accel
from vllm_omni_like.stages.diffusion.prompt_embeds import PromptEncoder
from vllm_omni_like.stages.diffusion.row_tensors import Text

CPU = torch.device("cpu")
TEXTS = ["a red circle", "a blue square on a green field beside a yellow triangle", None]


def _path(family: str) -> str:
    from tests.models.tiny_mmdit import tiny_flux_path, tiny_sd3_path
    from tests.models.tiny_sdxl import tiny_sdxl_path
    from tests.models.tiny_z_image import tiny_z_image_path
    from vllm_omni_like.models.tiny import ensure_tiny_model

    paths = {
        "sdxl": tiny_sdxl_path,
        "flux": tiny_flux_path,
        "sd3": tiny_sd3_path,
        "z-image": tiny_z_image_path,
    }
    if family in ("sd", "wan"):  # (the embedded tiny-image and tiny-video: UMT5)
        return ensure_tiny_model("tiny-image" if family == "sd" else "tiny-video")
    return paths[family]()


def _adapter(path: str) -> Adapter:
    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(path, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return adapter_for(pipe, family_of(path))


def _rows(text: Text) -> list[torch.Tensor]:
    return list(text.values()) if isinstance(text, dict) else [text]


ENCODERS = {
    "sd": ["text_encoder"],
    "sdxl": ["text_encoder", "text_encoder_2"],
    "flux": ["text_encoder", "text_encoder_2"],
    "sd3": ["text_encoder", "text_encoder_2", "text_encoder_3"],
    "z-image": ["text_encoder.layers.0-2"],  # (Qwen3 layer by layer: read at several lengths)
    "wan": ["text_encoder"],
}
HEAVIER = pytest.mark.drill  # (each compiles its family's encoders: seconds on two cores)


@pytest.mark.parametrize(
    "family", ["sd", *(pytest.param(f, marks=HEAVIER) for f in ENCODERS if f != "sd")]
)
def test_compiled_text_encoders_give_the_eager_embeddings_and_never_recompile(family):
    """Each text alone through the compiled encoders (aot_eager: dynamo's graphs and
    AOTAutograd's), the rows joined as the eager batch's are: equal within rounding; after
    the warm-up's texts, three texts of two buckets and an absent negative compile nothing."""
    from torch._dynamo.utils import counters

    adapter = _adapter(_path(family))
    tokenizer = getattr(adapter.pipe, "tokenizer", None)
    eager = PromptEncoder(adapter, CPU, tokenizer, None, torch.float32)
    with torch.inference_mode():
        want = eager(TEXTS)
    assert accel.compile_text_encoders(adapter, "default", "aot_eager") == ENCODERS[family]
    encoder = adapter.pipe.text_encoder
    assert type(encoder.layers[0] if family == "z-image" else encoder).__name__ == "OptimizedModule"
    compiled = dataclasses.replace(eager, one_text_a_call=True)
    with torch.inference_mode():  # the warm-up's texts (Z-Image's: each caption bucket's)
        for group in adapter.warm_up_prompts(CPU):
            compiled(list(group) if isinstance(group, tuple) else [group])
        graphs = counters["stats"]["unique_graphs"]
        got = compiled(TEXTS)
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled for the join
    for a, b in zip(_rows(want), _rows(got), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_the_flag_compiles_text_encoders_with_compile_on_cuda_or_when_asked():
    """auto: on with --compile on CUDA only (the CPU's encoders are not launch-bound); on: any
    device; off, or no --compile: never."""

    def config(**kw: Any) -> StageConfig:
        return StageConfig(name="d", kind="diffusion", **kw)

    assert text_encoders_compiled(config(compile=True), "cuda")
    assert not text_encoders_compiled(config(compile=True), "cpu")
    assert text_encoders_compiled(config(compile=True, compile_text_encoders="on"), "cpu")
    assert not text_encoders_compiled(config(compile=True, compile_text_encoders="off"), "cuda")
    assert not text_encoders_compiled(config(), "cuda")


def test_the_flag_refuses_on_without_compile_and_unknown_choices():
    with pytest.raises(ConfigError) as info:
        StageConfig(name="d", kind="diffusion", compile_text_encoders="on")
    assert str(info.value) == (
        "stage 'd': --compile-text-encoders on compiles the text encoders beside the denoiser, "
        "warmed up by its warm-up: it needs --compile"
    )
    with pytest.raises(ConfigError) as info:
        StageConfig(name="d", kind="diffusion", compile=True, compile_text_encoders="yes")
    assert str(info.value) == (
        "stage 'd': compile_text_encoders must be one of auto, on, off, not 'yes'"
    )


def test_the_cli_flag_reaches_the_stage():
    from vllm_omni_like.cli import _pipelines, build_parser

    args = build_parser().parse_args(
        ["serve", "null-image", "--compile", "--compile-text-encoders", "off"]
    )
    (stage,) = _pipelines(args)[0].stages
    assert stage.compile_text_encoders == "off" and stage.compile


def test_a_stage_whose_pipeline_call_runs_a_mode_keeps_its_encoders_eager(caplog):
    """The pipeline's own call encodes a batch's prompts at once (a shape a batch size): a
    stage with such a mode leaves its encoders eager and says why."""
    from vllm_omni_like.stage_options import DiffusionOptions
    from vllm_omni_like.stages.diffusion.load import _prompt_encoder
    from vllm_omni_like.wire import Mode

    caplog.set_level(logging.INFO, logger="vllm_omni_like.stages.diffusion.stage")
    adapter = _adapter(_path("sd"))
    config = StageConfig(name="d", kind="diffusion", compile=True, compile_text_encoders="on")
    options = DiffusionOptions(compile_backend="eager")
    text = _prompt_encoder(config, adapter.pipe, adapter, options, CPU, {Mode.EDIT})
    assert not text.one_text_a_call
    assert type(adapter.pipe.text_encoder).__name__ == "CLIPTextModel"
    assert "stage d: text encoders eager: edit run the pipeline's call" in caplog.text
    text = _prompt_encoder(config, adapter.pipe, adapter, options, CPU, set())
    assert text.one_text_a_call and "stage d: compiled text encoders text_encoder" in caplog.text
