"""Many LoRA adapters in one batch (stages/diffusion/lora_*.py) on the embedded tiny image model,
CPU fp32, through the stage: a batch mixing two adapters and the base gives each row its solo
image (a video model's too, and with both guidance branches in two forwards), scale 0 is the
base, a lightning adapter's steps apply to its rows only, and a request the stage cannot serve
(an unknown, broken or malformed adapter, more than the pool holds, a mode or a stage without
LoRA) fails alone. The pool itself: test_lora_pool.py; equality with diffusers'
load_lora_weights / fuse_lora / set_adapters: test_lora_diffusers.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.stages.diffusion.lora_helpers import (
    load_lora_stage,
    lora_request,
    low_rank,
    run_images,
    run_videos,
    tiny_image_pipe,
    wait_read,
    write_peft,
)
from vllm_omni_like.config import StageConfig
from vllm_omni_like.errors import ConfigError, InvalidRequestError
from vllm_omni_like.models.tiny import ensure_tiny_model
from vllm_omni_like.params import GenerationParams, LoraRef
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.wire import StageRequest

pytestmark = pytest.mark.slow
A, B = (LoraRef("a"),), (LoraRef("b", 0.8),)


def test_a_batch_mixing_two_adapters_and_the_base_gives_each_row_its_solo_image(lora_stage):
    batch = [
        lora_request("base"),
        lora_request("a", A),
        lora_request(
            "b", B, seed=4, guidance_scale=1.0
        ),  # (a row without guidance beside CFG rows)
        lora_request("ab", A + B, seed=5),
    ]
    together = run_images(lora_stage, batch)
    for r in batch:
        alone = run_images(lora_stage, [r])[r.request_id]
        assert np.abs(alone - together[r.request_id]).max() <= 1, r.request_id
    base = run_images(lora_stage, [lora_request("a", seed=3)])["a"]
    assert np.abs(together["a"] - base).mean() > 5  # (the adapter does something)
    assert (
        lora_stage.runtime.denoise.loras is not None and not lora_stage.runtime.denoise.loras.pins
    )


def test_scale_zero_is_the_base(lora_stage):
    out = run_images(lora_stage, [lora_request("base"), lora_request("zero", (LoraRef("b", 0.0),))])
    assert np.abs(out["base"] - out["zero"]).max() == 0


def test_a_lightning_adapter_runs_its_steps_and_guidance_on_its_rows_only(lora_stage):
    rt = lora_stage.runtime
    with torch.inference_mode():
        rows, _ = rt.denoise.rows(
            [
                lora_request("fast", (LoraRef("fast"),), num_inference_steps=None),
                lora_request("plain", num_inference_steps=None),
                lora_request("asked", (LoraRef("fast"),), num_inference_steps=3),
            ],
            rt.settings(),
        )
    steps = [r.state.schedule.iterations for r in rows]
    assert steps == [2, rt.defaults.steps, 3]
    assert [r.guidance for r in rows] == [1.0, rt.defaults.guidance, 1.0]
    assert rows[1].cfg and not rows[0].cfg


def test_a_request_naming_an_unknown_or_broken_adapter_fails_validation_alone(
    lora_stage, lora_files
):
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'nope'"):
        lora_stage.validate(lora_request("x", (LoraRef("nope"),)))
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter"):
        lora_stage.validate(lora_request("x", (LoraRef("../a"),)))
    broken = f"{lora_files['dir']}/broken.safetensors"
    with open(broken, "wb") as f:
        f.write(b"\x00" * 40)
    try:
        with pytest.raises(InvalidRequestError, match=r"broken\.safetensors cannot be read") as e:
            _verdict(lora_stage, lora_request("x", (LoraRef("broken"),)))
        assert e.value.code == "lora_unusable"
    finally:
        import os

        os.remove(broken)


def _verdict(stage: DiffusionStage, request: StageRequest) -> None:
    """Validation once the request's adapter files are read (its first validation starts the
    reads, off this thread, and judges only those already done)."""
    import contextlib

    with contextlib.suppress(InvalidRequestError):
        stage.validate(request)
    wait_read(stage.runtime.denoise.loras, request.params.loras)
    stage.validate(request)


def test_a_malformed_adapter_is_its_requests_400_and_the_worker_stays(lora_stage, lora_files):
    """Metadata that is not JSON (or a converter's own error) is the request's 400, not an
    exception out of the worker's validation (which would kill the worker)."""
    unet = tiny_image_pipe().unet
    bad = write_peft(
        f"{lora_files['dir']}/bad.safetensors",
        low_rank(unet, 6, 2),
        meta={"lora_adapter_metadata": "{not json"},
    )
    try:
        with pytest.raises(InvalidRequestError, match=r"'bad': unreadable \(JSONDecodeError") as e:
            _verdict(lora_stage, lora_request("x", (LoraRef("bad"),)))
        assert e.value.code == "lora_unusable"
    finally:
        import os

        os.remove(bad)
    assert (
        run_images(lora_stage, [lora_request("y", A)])["y"].shape[0] == 1
    )  # (the stage serves on)


def test_more_adapters_than_the_pool_holds_is_a_400_not_a_retry(lora_stage):
    small = lora_stage.runtime.denoise.loras
    assert small is not None
    max_loras, small.max_loras = small.max_loras, 1
    try:
        with pytest.raises(InvalidRequestError, match=r"pool holds 1 \(--max-loras\)"):
            lora_stage.validate(lora_request("x", (LoraRef("a"), LoraRef("b"))))
    finally:
        small.max_loras = max_loras


def test_a_registered_adapter_the_base_cannot_take_refuses_the_start(tmp_path):
    unet = tiny_image_pipe().unet
    bad = low_rank(unet, 1, 4, ends=("time_embedding.linear_1",))
    path = write_peft(tmp_path / "bad.safetensors", bad)
    loras = (f"t={path}",)
    config = StageConfig(
        name="diffusion", kind="diffusion", model="tiny-image", dtype="float32", loras=loras
    )
    s = DiffusionStage(config)
    with pytest.raises(ConfigError, match=r"time_embedding\.linear_1 is not an attention or MLP"):
        s.load("cpu")


def test_a_video_model_mixes_adapters_in_one_batch_too(tmp_path):
    """Wan (tiny-video): its converter returns no alphas; a row equals its solo video."""
    import diffusers

    path = ensure_tiny_model("tiny-video")
    model = diffusers.WanTransformer3DModel.from_pretrained(
        path, subfolder="transformer", dtype=torch.float32
    )
    ends = ("attn1.to_q", "attn2.to_v", "ffn.net.2")
    weights = low_rank(model, 1, 4, ends=ends, std=0.5)
    file = write_peft(tmp_path / "v.safetensors", weights, prefix="transformer")
    video = load_lora_stage("tiny-video", (f"v={file}",), 4)
    try:

        def req(rid: str, loras=()) -> StageRequest:
            p = GenerationParams(seed=1, num_inference_steps=2, num_frames=5, loras=loras)
            return StageRequest(rid, "a red circle moving right", p, mode="text2video")

        batch = [req("base"), req("v", (LoraRef("v"),))]
        together = run_videos(video, batch)
        for r in batch:
            assert np.abs(run_videos(video, [r])[r.request_id] - together[r.request_id]).max() <= 1
        assert np.abs(together["v"] - together["base"]).mean() > 5
    finally:
        video.close()


def test_a_mode_our_loop_does_not_run_or_a_stage_without_a_pool_refuses_a_lora(lora_stage):
    rt, own = lora_stage.runtime, lora_stage.runtime.own
    rt.own = set()  # (as if the pipeline's call ran every mode)
    try:
        with pytest.raises(InvalidRequestError) as info:
            lora_stage.validate(lora_request("x", A))
        assert str(info.value) == (
            "LoRA adapters run on our own loop; this model's text2img runs the pipeline's call"
        )
    finally:
        rt.own = own
    pool, rt.denoise.loras = rt.denoise.loras, None
    try:
        with pytest.raises(InvalidRequestError) as info:
            lora_stage.validate(lora_request("x", A))
        assert str(info.value) == "this model serves no LoRA adapters (--lora, --lora-dir)"
    finally:
        rt.denoise.loras = pool


def test_both_branches_in_two_forwards_take_the_rows_adapters(lora_files):
    loras = (f"b={lora_files['b']}",)
    two = load_lora_stage("tiny-image", loras, 8, batched_cfg=False)
    try:
        batch = [lora_request("base"), lora_request("b", B, seed=4)]
        split = run_images(two, batch)
    finally:
        two.close()
    alone = _run_one_forward(lora_files, batch)
    for r in batch:
        assert np.abs(split[r.request_id] - alone[r.request_id]).max() <= 1, r.request_id


def _run_one_forward(files, batch):
    one = load_lora_stage("tiny-image", (f"b={files['b']}",), 8)
    try:
        return run_images(one, batch)
    finally:
        one.close()
