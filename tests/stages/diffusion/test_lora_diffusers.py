"""A LoRA row of our loop (stages/diffusion/lora_*.py) equals diffusers' own adapter loads at
the same seed, CPU fp32: `load_lora_weights` + `fuse_lora` (peft and kohya files), three
adapters through `set_adapters`, and a two-expert Wan's adapters loaded into both experts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.stages.diffusion.lora_helpers import (
    expert_files,
    load_lora_stage,
    lora_request,
    pipeline_image,
    psnr,
    run_images,
    run_videos,
    tiny_image_pipe,
)
from vllm_omni_like.errors import InvalidRequestError
from vllm_omni_like.params import GenerationParams, LoraRef
from vllm_omni_like.wire import StageRequest

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("name", "scale"), [("b", 0.8), ("kohya", 1.0)])
def test_a_row_equals_diffusers_load_lora_weights_and_fuse_lora(
    lora_stage, lora_files, name, scale
):
    ours = run_images(lora_stage, [lora_request("x", (LoraRef(name, scale),), seed=11)])["x"][0]
    pipe = tiny_image_pipe()
    pipe.load_lora_weights(lora_files[name])
    pipe.fuse_lora(lora_scale=scale)
    theirs = pipeline_image(pipe, lora_stage, 11)
    assert psnr(ours, theirs) >= 35


def test_three_adapters_in_one_request_equal_diffusers_set_adapters_and_fuse(
    lora_stage, lora_files
):
    """More than two adapters a row (`--max-loras-per-request`, 4 by default): three at their
    scales equal diffusers' load_lora_weights of each, set_adapters with those weights and
    fuse_lora, at the same seed; a fifth is refused by the stage too."""
    scales = {"a": 1.0, "b": 0.8, "kohya": 0.5}
    refs = tuple(LoraRef(n, s) for n, s in scales.items())
    ours = run_images(lora_stage, [lora_request("x", refs, seed=12), lora_request("base", seed=12)])
    pipe = tiny_image_pipe()
    import warnings

    with warnings.catch_warnings():  # (peft: "multiple adapters in the model", as asked)
        warnings.simplefilter("ignore", UserWarning)
        for name in scales:
            pipe.load_lora_weights(lora_files[name], adapter_name=name)
    pipe.set_adapters(list(scales), adapter_weights=list(scales.values()))
    pipe.fuse_lora(adapter_names=list(scales))
    theirs = pipeline_image(pipe, lora_stage, 12)
    assert psnr(ours["x"][0], theirs) >= 35
    assert psnr(ours["base"][0], theirs) < 30  # (the three adapters do something)
    five = tuple(LoraRef(n) for n in ("a", "b", "kohya", "c", "fast"))
    with pytest.raises(InvalidRequestError) as info:
        lora_stage.validate(lora_request("y", five))
    assert str(info.value) == "at most 4 LoRA adapters a request (--max-loras-per-request)"


def _video_req(rid: str, loras=(), seed: int = 1) -> StageRequest:
    p = GenerationParams(
        seed=seed,
        num_inference_steps=2,
        num_frames=5,
        guidance_scale=4.0,
        loras=loras,
        width=64,
        height=64,
    )
    return StageRequest(rid, "a red circle moving right", p, mode="text2video")


def test_two_experts_take_an_adapter_as_diffusers_loads_it_into_both(tmp_path):
    """Wan2.2-A14B's shape: one pool over both experts' layers; a file's `transformer.` keys in
    both, or its `transformer_2.` keys in the second; each row equals diffusers' loads of the
    same into each expert + fuse_lora at the same seed, in one batch beside the base (two
    steps: one of each expert)."""
    import diffusers

    from tests.models.tiny_wan22 import tiny_wan22_experts_path

    files = expert_files(tmp_path)
    path = tiny_wan22_experts_path()
    stage = load_lora_stage(path, (f"both={files['both']}", f"each={files['each']}"), 4)
    try:
        batch = [
            _video_req("both", (LoraRef("both"),)),
            _video_req("base"),
            _video_req("each", (LoraRef("each", 0.8),)),
        ]
        together = run_videos(stage, batch)
    finally:
        stage.close()
    for name, loads, scale in (
        ("both", ((files["both"], False), (files["both"], True)), 1.0),
        ("each", ((files["1"], False), (_renamed(files["2"]), True)), 0.8),
    ):
        pipe = diffusers.WanPipeline.from_pretrained(
            path, local_files_only=True, dtype=torch.float32
        )
        pipe.set_progress_bar_config(disable=True)
        for file, second in loads:
            pipe.load_lora_weights(file, load_into_transformer_2=second)
        pipe.fuse_lora(components=["transformer", "transformer_2"], lora_scale=scale)
        with torch.inference_mode():
            out = pipe(
                "a red circle moving right",
                max_sequence_length=pipe.tokenizer.model_max_length,  # (the stage's text)
                num_inference_steps=2,
                num_frames=5,
                guidance_scale=4.0,
                width=64,
                height=64,
                generator=torch.Generator().manual_seed(1),
                output_type="np",
            )
        theirs = (out.frames[0] * 255).round().astype(int)
        assert psnr(together[name], theirs) >= 35, name
    assert np.abs(together["both"] - together["base"]).mean() > 5


def _renamed(path: str) -> dict[str, torch.Tensor]:
    """A `transformer_2.` file's keys as `transformer.` (diffusers loads a second expert's
    adapter from those, with load_into_transformer_2)."""
    import safetensors.torch

    tensors = safetensors.torch.load_file(path)
    return {k.replace("transformer_2.", "transformer.", 1): v for k, v in tensors.items()}
