import sys
import threading

import numpy as np
import pytest

from vllm_omni_like.config import StageConfig
from vllm_omni_like.errors import InvalidRequestError
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.base import StageAborted, StageControl
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.stages.null import NullStage
from vllm_omni_like.wire import StageRequest


def _stage(output="image"):
    stage = NullStage(StageConfig(name="diffusion", kind="null", options={"output": output}))
    stage.load("cpu")
    return stage


def _control(progress=None):
    return StageControl(FaultInjector((), "diffusion"), progress)


def test_output_is_deterministic_in_seed_and_prompt():
    stage = _stage()
    r = StageRequest("a", "cat", GenerationParams(seed=3, n=2, width=16, height=8))
    one = stage.execute([r], _control())[0]
    two = stage.execute([r], _control())[0]
    assert [i.seed for i in one.images] == [3, 4]
    assert one.images[0].pixels.shape == (8, 16, 3)
    assert all(
        np.array_equal(x.pixels, y.pixels) for x, y in zip(one.images, two.images, strict=True)
    )
    other = stage.execute([StageRequest("b", "dog", GenerationParams(seed=3))], _control())[0]
    assert not np.array_equal(other.images[0].pixels[:8, :16], one.images[0].pixels)


def test_text_and_video_outputs():
    text = _stage("text").execute([StageRequest("a", "cat", GenerationParams(seed=1))], _control())
    assert text[0].text.startswith("cat (rewritten #")
    video = _stage("video").execute(
        [StageRequest("a", "cat", GenerationParams(seed=1, num_frames=3, fps=4))], _control()
    )
    assert video[0].video.frames.shape == (3, 64, 64, 3) and video[0].video.fps == 4


def test_progress_every_step_and_step_counts():
    seen = []
    control = _control(lambda ids, step, total, previews, progress: seen.append((ids, step, total)))
    _stage().execute([StageRequest("a", "cat", GenerationParams(num_inference_steps=3))], control)
    assert seen == [(["a"], 1, 3), (["a"], 2, 3), (["a"], 3, 3)]
    assert control.steps_run == {"a": 3}


def test_abort_between_steps_stops_when_no_peer_needs_the_batch():
    control = _control()
    reqs = [
        StageRequest(r, "cat", GenerationParams(num_inference_steps=50, step_delay=0.01))
        for r in ("a", "b")
    ]
    threading.Timer(0.1, control.abort, args=(["a"],)).start()
    threading.Timer(0.2, control.abort, args=(["b"],)).start()
    with pytest.raises(StageAborted):
        _stage().execute(reqs, control)
    assert control.steps_run["a"] < control.steps_run["b"] < 50
    # the worker's own count: no step ran for either after its abort arrived
    assert control.steps_after_abort(["a", "b", "c"]) == {"a": 0, "b": 0}
    assert control.steps_at_abort["a"] == control.steps_run["a"] > 0


def test_validate_refuses_absurd_sizes():
    with pytest.raises(InvalidRequestError, match="width 5000"):
        _stage().validate(StageRequest("a", "cat", GenerationParams(width=5000)))


def test_null_stage_does_not_import_torch():
    assert "vllm_omni_like.stages.null" in sys.modules
    import subprocess

    code = "import sys, vllm_omni_like.stages.null as n; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
