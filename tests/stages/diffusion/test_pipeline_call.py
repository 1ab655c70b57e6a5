"""The diffusion stage answers diffusers' per-call lookups from its load (acceleration.py:
pin_execution_device, the CFG wrappers' dtype, the text encoders' device from encoder_lookups):
a denoising loop walks no model's modules."""

from __future__ import annotations

import diffusers.hooks.group_offloading as offloading
import diffusers.models.modeling_utils as modeling
import numpy as np
import pytest

from vllm_omni_like.config import StageConfig
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.wire import StageRequest

pytestmark = pytest.mark.slow


def test_a_video_batch_walks_no_modules_and_equals_the_walking_pipeline(monkeypatch):
    stage = DiffusionStage(StageConfig(name="diffusion", kind="diffusion", model="tiny-video"))
    stage.load("cpu")
    rt = stage.runtime
    pipe = rt.pipe
    assert type(pipe).__name__ == "WanPipeline" and type(pipe).__mro__[1].__name__ == "WanPipeline"
    assert pipe._execution_device == rt.device and pipe.transformer.dtype == rt.text.dtype
    batch = [
        StageRequest(
            "v",
            "a red square moving left",
            GenerationParams(seed=3, num_inference_steps=3, num_frames=5),
            mode="text2video",
        )
    ]
    control = StageControl(FaultInjector((), "diffusion"))
    calls: dict[str, list[str]] = {"onload": [], "dtype": []}
    onload, dtype = offloading._get_group_onload_device, modeling.get_parameter_dtype

    def counted(name, real):
        def call(module, *args, **kwargs):
            calls[name].append(type(module).__name__)
            return real(module, *args, **kwargs)

        return call

    monkeypatch.setattr(offloading, "_get_group_onload_device", counted("onload", onload))
    monkeypatch.setattr(modeling, "get_parameter_dtype", counted("dtype", dtype))
    part = stage.begin(batch, control)
    # no walk over any model's modules (the text encoder's device, which diffusers' own
    # `encode_prompt` asks for, is the load's: encoder_lookups.py)
    assert calls == {"onload": [], "dtype": []}
    pinned = part.finish(batch)[0].video.frames
    # the pipeline's own call with diffusers' own lookups (the walks) gives the same video (one
    # level apart at most: our loop runs both guidance branches in one forward)
    monkeypatch.setattr(type(pipe), "_execution_device", type(pipe).__mro__[1]._execution_device)
    monkeypatch.setattr(stage.runtime, "own", set())
    walked = stage.execute(batch, control)[0].video.frames
    assert "WanTransformer3DModel" in calls["onload"]
    assert np.abs(pinned.astype(int) - walked.astype(int)).max() <= 1
    stage.close()
