"""Image to video on tiny models (tests/models/tiny_wan22.py): Wan2.2-TI2V's first frame through
WanImageToVideoPipeline over its own models, Wan2.2-I2V-A14B's two experts with their own
scales (Wan2.1-I2V's CLIP-conditioned shape keeps the family contract: test_family_contract.py).
The stage makes what the pipeline makes from the frame it fits - scaled to cover the size and
cut from the centre, never stretched - each request alone in its batch, and each model refuses
the mode it lacks."""

from __future__ import annotations

import dataclasses

import diffusers
import numpy as np
import pytest
import torch

from tests.models import test_family_contract as contract
from tests.models.tiny_wan22 import tiny_wan22_i2v_experts_path, tiny_wan22_ti2v_path
from vllm_omni_like.errors import InvalidRequestError
from vllm_omni_like.models.adapter import adapter_for
from vllm_omni_like.models.registry import family_of
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.diffusion.edits import first_frame
from vllm_omni_like.stages.torch_utils import tensor_to_uint8
from vllm_omni_like.wire import StageRequest

pytestmark = pytest.mark.slow
OPTIONS = {"default_size": 64}
PARAMS = GenerationParams(seed=3, num_inference_steps=3, num_frames=5, width=64, height=32)


def _request(rid: str = "r", **kw) -> StageRequest:
    params = dataclasses.replace(PARAMS, **kw)
    return StageRequest(
        rid, "a red circle", params, mode="image2video", images=[contract.EDIT_IMAGE]
    )


def _case(path: str) -> contract.Case:
    return contract.Case(family_of(path).name, path, path, True, True, OPTIONS)


def test_the_first_frame_covers_the_size_from_the_centre():
    wide = np.zeros((40, 80, 3), np.uint8)
    wide[..., 0] = np.arange(80)  # each column says where it came from
    frame = np.asarray(first_frame(StageRequest("r", "x", PARAMS, images=[wide]), 40, 40))
    assert frame.shape == (40, 40, 3)
    assert np.array_equal(frame[0, :, 0], np.arange(20, 60))  # not squeezed: cut
    tall = np.asarray(first_frame(StageRequest("r", "x", PARAMS, images=[wide]), 160, 40))
    assert tall.shape == (40, 160, 3)  # scaled up 2x to cover, then cut


def test_ti2v_makes_from_a_first_frame_what_diffusers_image_to_video_pipeline_makes():
    path = tiny_wan22_ti2v_path()
    stage = _case(path).stage()
    family = stage.runtime.family
    assert family.modes == ("text2video", "image2video")
    got = contract._run(stage, _request())
    base = diffusers.WanPipeline.from_pretrained(path, dtype=torch.float32)
    pipe = diffusers.WanImageToVideoPipeline(**base.components, expand_timesteps=True)
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        want = pipe(
            image=first_frame(_request(), 64, 32),
            **adapter_for(base, family).text_kwargs(["a red circle"], [""], base.tokenizer),
            num_frames=5,
            width=64,
            height=32,
            num_inference_steps=3,
            guidance_scale=stage.runtime.defaults.guidance,
            generator=[torch.Generator().manual_seed(3)],
            output_type="pt",
        ).frames
    want = tensor_to_uint8(want)[0]
    assert got.shape == want.shape == (5, 32, 64, 3)
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1
    text = contract._run(stage, StageRequest("t", "a red circle", PARAMS, mode="text2video"))
    assert np.abs(text.astype(int) - want.astype(int)).max() > 1  # (the image counts)


def test_the_image_only_experts_take_their_own_scales():
    case = _case(tiny_wan22_i2v_experts_path())
    stage = case.stage()
    got = contract._run(stage, _request(guidance_scale_2=2.0))
    pipe = case.pipeline()
    kw = {
        "num_inference_steps": 3,
        "width": 64,
        "height": 32,
        "image": first_frame(_request(), 64, 32),
    }
    want = contract._pixels(case, case.call(pipe, guidance_scale_2=2.0, **kw))
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1
    same = contract._pixels(case, case.call(pipe, **kw))
    assert np.abs(want.astype(int) - same.astype(int)).max() > 1  # (the scale counts)


def test_each_model_refuses_the_mode_it_lacks_and_requests_never_share_a_call():
    i2v = _case(tiny_wan22_i2v_experts_path()).stage()
    with pytest.raises(InvalidRequestError, match="makes videos from an image"):
        i2v.validate(StageRequest("r", "x", PARAMS, mode="text2video"))
    t2v = contract.Case(
        "wan", "tiny-video", contract.ensure_tiny_model("tiny-video"), True, False
    ).stage()
    with pytest.raises(InvalidRequestError, match="from text only"):
        t2v.validate(_request())
    assert _request("a").batch_key() != _request("b").batch_key()  # one image a call
    text = [StageRequest(r, "x", PARAMS, mode="text2video") for r in "ab"]
    assert text[0].batch_key() == text[1].batch_key()


@pytest.mark.parametrize("model", ["wan2.1-i2v", "wan2.2-i2v-a14b"])
def test_a_video_from_an_image_that_joins_a_busy_set_at_step_k_makes_what_it_makes_alone(model):
    """Our loop's image-to-video rows (Wan2.1's CLIP features; A14B's two experts, rows on both
    sides of the boundary in one step) join a busy set at a step boundary, each with its own
    first frame's condition, steps, guidance and seed: each video is the one it makes alone."""
    from tests.stages.diffusion.test_running_set import _Harness
    from vllm_omni_like.wire import Mode

    path = tiny_wan22_i2v_experts_path() if model.endswith("a14b") else contract.TINY["wan-i2v"]()
    stage = _case(path).stage()
    assert stage.runtime.loops[Mode.IMAGE2VIDEO] == ("own", None)
    other = contract.EDIT_IMAGE[::-1, ::-1].copy()
    a = _request("a", num_inference_steps=6)
    b = StageRequest("b", "a blue square", dataclasses.replace(PARAMS, seed=4), "image2video")
    b.images = [other]
    c = _request("c", seed=5, num_inference_steps=4, guidance_scale=1.0)
    if model.endswith("a14b"):
        b = dataclasses.replace(b, params=dataclasses.replace(b.params, guidance_scale_2=1.5))
    own = frozenset(stage.runtime.own)
    assert a.batch_key(own) == b.batch_key(own) == c.batch_key(own)  # (one shape group)

    alone = {r.request_id: _alone(stage, r) for r in (a, b, c)}
    h = _Harness(stage)
    h.add(1, a)
    h.steps(2)  # (A14B: a's third timestep is under the boundary; b's and c's first above it)
    h.add(2, b, c)
    assert [lane.batch_ids for lane in h.rows.lanes] == [[1, 2]]
    h.steps()
    for rid, video in alone.items():
        assert np.abs(frames(h, rid) - video).max() <= 1, rid


def test_ti2v_rows_from_text_and_from_a_frame_share_a_set_and_a_forward():
    """Wan2.2-TI2V on our loop: videos from a first frame and from text are one shape group;
    a text row joins a busy set of rows from frames at a step boundary (and another frame's row
    with it), every row steps in one forward - a frame's tokens at timestep 0, the frame put
    back after each step - and each video is the one it makes alone."""
    from tests.stages.diffusion.test_running_set import _Harness
    from vllm_omni_like.wire import Mode

    stage = _case(tiny_wan22_ti2v_path()).stage()
    assert stage.runtime.loops == {m: ("own", None) for m in (Mode.TEXT2VIDEO, Mode.IMAGE2VIDEO)}
    a = _request("a", num_inference_steps=6)
    b = StageRequest("b", "a blue square", dataclasses.replace(PARAMS, seed=4), "text2video")
    c = _request("c", seed=5, num_inference_steps=4, guidance_scale=1.0)
    c.images = [contract.EDIT_IMAGE[::-1, ::-1].copy()]
    own = frozenset(stage.runtime.own)
    assert a.batch_key(own) == b.batch_key(own) == c.batch_key(own)  # (one shape group)

    alone = {r.request_id: _alone(stage, r) for r in (a, b, c)}
    h = _Harness(stage)
    h.add(1, a)
    h.steps(2)
    h.add(2, b, c)
    assert [lane.batch_ids for lane in h.rows.lanes] == [[1, 2]]
    batches = stage.runtime.probe
    h.steps(1)
    assert batches.max_seen == 5  # (one forward: a's and b's two branches, c's one)
    h.steps()
    for rid, video in alone.items():
        assert np.abs(frames(h, rid) - video).max() <= 1, rid


def frames(h, rid: str) -> np.ndarray:
    """A request's video frames from a harness, its error none."""
    out = h.outputs[rid]
    assert out.error is None, out.error
    return out.video.frames.astype(np.int16)


def _alone(stage, request) -> np.ndarray:
    """The video a request makes alone in a running set."""
    from tests.stages.diffusion.test_running_set import _Harness

    h = _Harness(stage)
    h.add(1, request)
    h.steps()
    return frames(h, request.request_id)
