"""The messages that cross processes: a request's mode is one `Mode`, a `str` enum, so what was
written as a string before it (a pickle, a log line, JSON) still reads the same."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from vllm_omni_like.config import PipelineConfig, StageConfig
from vllm_omni_like.inputs import OmniRequest
from vllm_omni_like.models.registry import FAMILIES
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.pipelines.base import Pipeline
from vllm_omni_like.wire import Mode, StageRequest, WorkerReady


def test_a_mode_is_its_string():
    assert [m.value for m in Mode] == [
        "text",
        "text2img",
        "edit",
        "text2video",
        "image2video",
        "inpaint",
    ]
    assert Mode.EDIT == "edit" and hash(Mode.EDIT) == hash("edit")
    assert "edit" in {Mode.EDIT} and Mode.EDIT in {"edit"}
    assert f"{Mode.TEXT2VIDEO}" == "text2video" == str(Mode.TEXT2VIDEO)
    assert json.dumps({Mode.TEXT2IMG: Mode.EDIT}) == '{"text2img": "edit"}'


def test_a_mode_given_as_its_string_is_the_member_and_an_unknown_one_is_refused():
    request = StageRequest("r", "a cat", mode="image2video")
    assert request.mode is Mode.IMAGE2VIDEO
    assert StageRequest("r", "a cat").mode is Mode.TEXT2IMG
    with pytest.raises(ValueError, match="'paint' is not a valid Mode"):
        StageRequest("r", "a cat", mode="paint")


def test_messages_pickle_with_their_modes():
    ready = pickle.loads(pickle.dumps(WorkerReady(0, 1, "cpu", stepped=(Mode.TEXT2IMG,))))
    assert ready.stepped == (Mode.TEXT2IMG,) and ready.stepped[0] is Mode.TEXT2IMG
    request = pickle.loads(pickle.dumps(StageRequest("r", "a cat", mode=Mode.EDIT)))
    assert request.mode is Mode.EDIT


def test_a_request_pickled_with_a_string_mode_batches_as_its_member():
    """A message pickled before modes were an enum holds a plain string (unpickling runs no
    __post_init__): it batches with the same key as one holding the member."""
    params = GenerationParams(width=64, height=64, num_inference_steps=3)
    image = [np.zeros((8, 8, 3), np.uint8)]
    for mode, images in ((Mode.EDIT, image), (Mode.TEXT2IMG, []), (Mode.IMAGE2VIDEO, image)):
        new = StageRequest("r", "a cat", params, mode, images=images)
        old = StageRequest("r", "a cat", params, mode, images=images)
        object.__setattr__(old, "mode", mode.value)
        old = pickle.loads(pickle.dumps(old))
        assert type(old.mode) is str and old.mode == new.mode
        assert old.batch_key() == new.batch_key()
        assert old.batch_key(frozenset({mode})) == new.batch_key(frozenset({mode}))


def test_an_image_to_image_edit_of_a_given_size_groups_with_text_rows_on_our_loop():
    """Our loop: an img2img edit of a given size shares the text rows' shape group (the same
    denoiser input); one of the upload's size, an inpainting edit (its own loop mode) or an
    edit by instruction (no text-to-image beside it) keys on its upload's shape."""
    upload = [np.zeros((40, 56, 3), np.uint8)]
    sized = GenerationParams(width=64, height=64, num_inference_steps=3)
    text = StageRequest("t", "a cat", sized)
    edit = StageRequest("e", "a dog", sized, Mode.EDIT, images=upload)
    both = frozenset({Mode.TEXT2IMG, Mode.EDIT})
    assert edit.loop_mode is Mode.EDIT and edit.batch_key(both) == text.batch_key(both)
    unsized = StageRequest("u", "a dog", mode=Mode.EDIT, images=upload)
    assert unsized.batch_key(both) == (Mode.EDIT, None, None, None, (40, 56))
    mask = np.zeros((40, 56), np.uint8)
    inpaint = StageRequest("i", "a dog", sized, Mode.EDIT, images=upload, mask=mask)
    assert inpaint.loop_mode is Mode.INPAINT and inpaint.mode is Mode.EDIT
    assert inpaint.batch_key(both) != text.batch_key(both)  # (a shape group of its own)
    inpaints = frozenset({Mode.TEXT2IMG, Mode.EDIT, Mode.INPAINT})
    small, large = (
        StageRequest(r, "a dog", mode=Mode.EDIT, images=[np.zeros(s, np.uint8)], mask=mask)
        for r, s in (("s", (40, 56, 3)), ("l", (64, 56, 3)))
    )
    assert small.batch_key(inpaints) != large.batch_key(inpaints)  # (sized by their uploads)
    instruction = frozenset({Mode.EDIT})
    assert edit.batch_key(instruction) == (Mode.EDIT, 64, 64, None, (40, 56))
    other = StageRequest("o", "a dog", sized, Mode.EDIT, images=[np.zeros((56, 40, 3), np.uint8)])
    assert other.batch_key(instruction) != edit.batch_key(instruction)  # (another fit)


def test_a_video_from_a_first_frame_groups_with_text_rows_where_our_loop_runs_both():
    """Wan2.2-TI2V: rows from a first frame and from text share a shape group on our loop
    (the same denoiser input); where our loop runs image to video only (Wan-I2V) they group by
    shape; on the pipeline's call each request is a call of its own (one image a call)."""
    upload = [np.zeros((40, 56, 3), np.uint8)]
    params = GenerationParams(width=64, height=32, num_frames=5)
    text = StageRequest("t", "a cat", params, Mode.TEXT2VIDEO)
    frames = [StageRequest(r, "a dog", params, Mode.IMAGE2VIDEO, images=upload) for r in "ab"]
    both = frozenset({Mode.TEXT2VIDEO, Mode.IMAGE2VIDEO})
    assert frames[0].batch_key(both) == frames[1].batch_key(both) == text.batch_key(both)
    alone = frozenset({Mode.IMAGE2VIDEO})
    assert frames[0].batch_key(alone) == frames[1].batch_key(alone) != text.batch_key(both)
    assert frames[0].batch_key() != frames[1].batch_key()


def test_the_families_and_pipelines_speak_in_modes():
    for family in FAMILIES:
        assert family.modes and all(type(m) is Mode for m in family.modes), family.name
        assert all(type(m) is Mode for m in family.own_loop), family.name
        assert set(family.own_loop) <= set(family.modes), family.name
    stages = (StageConfig("llm", "null", options={"output": "text"}), StageConfig("d", "null"))
    image = Pipeline(PipelineConfig("p", stages))
    video = Pipeline(PipelineConfig("v", stages[1:], output="video"))
    plain, edit = OmniRequest("r", "a cat", "p"), OmniRequest("r", "a cat", "p", images=[object()])
    assert [image._mode(i, plain) for i in (0, 1)] == [Mode.TEXT, Mode.TEXT2IMG]
    assert image._mode(1, edit) is Mode.EDIT
    assert (video._mode(0, plain), video._mode(0, edit)) == (Mode.TEXT2VIDEO, Mode.IMAGE2VIDEO)
