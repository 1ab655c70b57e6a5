"""Diffusion and LLM stages on the embedded tiny models, in real worker processes."""

from __future__ import annotations

import queue

import numpy as np
import psutil
import pytest

from tests.conftest import drain_batch
from vllm_omni_like.config import FaultRule, StageConfig
from vllm_omni_like.executor import MultiprocExecutor
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.wire import BatchDone, ExecuteBatch, RequestResult, StageRequest

pytestmark = pytest.mark.slow
FAULTS = (FaultRule("diffusion", "step", "raise", match="@midstep"),)


class Runner:
    """One real worker process for a stage, with a helper to run a batch and collect results."""

    def __init__(self, config: StageConfig) -> None:
        self.sink: queue.Queue = queue.Queue()
        self.ex = MultiprocExecutor(config, 0, self.sink.put, FAULTS)
        self.ex.start()
        self.next_id = 0

    def run(self, requests: list[StageRequest]) -> tuple[dict, BatchDone]:
        self.next_id += 1
        self.ex.execute(ExecuteBatch(self.next_id, requests))
        msgs = drain_batch(self.sink, self.next_id, timeout=60)
        results = {m.output.request_id: m.output for m in msgs if isinstance(m, RequestResult)}
        return results, msgs[-1]

    def close(self) -> None:
        pids = self.ex.pids
        self.ex.shutdown()
        assert not any(psutil.pid_exists(p) for p in pids), "worker left behind"


@pytest.fixture(scope="module")
def image_stage():
    runner = Runner(StageConfig(name="diffusion", kind="diffusion", model="tiny-image"))
    yield runner
    runner.close()


def _img(rid, prompt="a red circle", seed=1, **kw):
    params = {"num_inference_steps": 4, "seed": seed, **kw}
    return StageRequest(rid, prompt, GenerationParams(**params))


def test_image_batch_reaches_the_model_as_one_batch(image_stage):
    reqs = [
        _img(f"b{i}", f"a {c} circle", seed=i, guidance_scale=1.0)
        for i, c in enumerate(("red", "blue", "green"))
    ]
    results, done = image_stage.run(reqs)
    assert done.batch_size == 3 and done.model_batch_dim == 3  # no CFG: 3 rows, one forward
    for i, r in enumerate(reqs):
        out = results[r.request_id]
        assert out.error is None and out.steps_run == 4
        assert out.images[0].pixels.shape == (64, 64, 3) and out.images[0].seed == i
    single, done1 = image_stage.run([_img("s1", "a blue circle", seed=1, guidance_scale=1.0)])
    assert done1.model_batch_dim == 1
    diff = np.abs(
        single["s1"].images[0].pixels.astype(int) - results["b1"].images[0].pixels.astype(int)
    )
    assert diff.max() <= 2  # same seed, same image, whatever the batch


def test_classifier_free_guidance_doubles_the_model_batch(image_stage):
    _, done = image_stage.run([_img("g1", guidance_scale=7.5), _img("g2", guidance_scale=7.5)])
    assert done.model_batch_dim == 4


def test_n_images_use_consecutive_seeds(image_stage):
    results, _ = image_stage.run([_img("n2", n=2, seed=10)])
    assert [im.seed for im in results["n2"].images] == [10, 11]
    assert not np.array_equal(results["n2"].images[0].pixels, results["n2"].images[1].pixels)


def test_request_faults_inside_the_stage_are_per_request(image_stage):
    reqs = [
        _img("ok1"),
        _img("big", width=70),
        _img("mid", "x @midstep"),
        _img("ok2"),
        _img("long", "red " * 40),
    ]
    results, _ = image_stage.run(reqs)
    assert results["ok1"].error is None and results["ok2"].error is None
    big = results["big"].error
    assert (big.status, big.code, big.param) == (400, "invalid_size", "size")
    assert big.message == (
        "stage 'diffusion': size 70x64 is not supported by tiny-image: it makes width and "
        "height multiples of 8 from 8 to 128 (max_side 128)"
    )
    long = results["long"].error
    assert (long.status, long.code) == (400, "prompt_too_long")
    assert "42 tokens long; the text encoder takes at most 32" in long.message
    mid = results["mid"].error
    assert mid.status == 500 and "injected raise fault at step" in mid.message


def test_rewritten_prompts_are_truncated_not_refused(image_stage):
    req = _img("t", "red " * 40)
    req.truncate_prompt = True
    results, _ = image_stage.run([req])
    assert results["t"].error is None and results["t"].images


def test_edit_with_and_without_mask(image_stage):
    base = np.full((64, 64, 3), 200, dtype=np.uint8)
    mask = np.zeros((64, 64), dtype=np.uint8)
    mask[:, :32] = 255  # repaint the left half only
    inpaint = StageRequest(
        "m",
        "a blue square",
        GenerationParams(seed=3, num_inference_steps=4, strength=1.0),
        mode="edit",
        images=[base],
        mask=mask,
    )
    img2img = StageRequest(
        "i",
        "a blue square",
        GenerationParams(seed=3, num_inference_steps=4),
        mode="edit",
        images=[base],
    )
    results, _ = image_stage.run([inpaint])
    results.update(image_stage.run([img2img])[0])
    assert results["m"].error is None and results["i"].error is None
    out = results["m"].images[0].pixels.astype(int)
    # the kept half stays close to the input, the repainted half moves away from it
    kept, painted = np.abs(out[:, 40:] - 200).mean(), np.abs(out[:, :24] - 200).mean()
    assert painted > kept


def test_video_batch():
    runner = Runner(StageConfig(name="diffusion", kind="diffusion", model="tiny-video"))
    try:
        reqs = [
            StageRequest(
                f"v{i}",
                "a red square moving left",
                GenerationParams(
                    seed=i, num_inference_steps=3, num_frames=9, guidance_scale=1.0, fps=8
                ),
                mode="text2video",
            )
            for i in range(2)
        ]
        results, done = runner.run(reqs)
        assert done.model_batch_dim == 2
        for r in reqs:
            video = results[r.request_id].video
            assert video.frames.shape == (9, 64, 64, 3) and video.frames.dtype == np.uint8
            assert video.fps == 8
        wrong, _ = runner.run([_img("img-on-video")])
        assert wrong["img-on-video"].error.message == (
            "stage 'diffusion': this model makes videos, not images"
        )
    finally:
        runner.close()


def test_llm_batch_with_per_request_sampling():
    runner = Runner(StageConfig(name="llm", kind="llm", model="tiny-llm"))
    try:
        reqs = [
            StageRequest(
                f"l{i}",
                "red circle",
                GenerationParams(seed=i, temperature=0.9 if i else 0.0, max_new_tokens=8),
                mode="text",
            )
            for i in range(3)
        ]
        results, done = runner.run(reqs)
        assert done.model_batch_dim == 3
        assert all(results[r.request_id].error is None for r in reqs)
        assert len(results["l1"].token_ids) <= 8
        alone, _ = runner.run(
            [
                StageRequest(
                    "x",
                    "red circle",
                    GenerationParams(seed=2, temperature=0.9, max_new_tokens=8),
                    mode="text",
                )
            ]
        )
        assert alone["x"].token_ids == results["l2"].token_ids  # same seed, any batch
        too_long, _ = runner.run([StageRequest("big", "red " * 200, mode="text")])
        assert too_long["big"].error.code == "prompt_too_long"
    finally:
        runner.close()


def test_dummy_load_format_builds_the_same_architecture_with_random_weights():
    from vllm_omni_like.models.tiny import ensure_tiny_model
    from vllm_omni_like.stages.diffusion.stage import DiffusionStage

    path = ensure_tiny_model("tiny-image")
    real = DiffusionStage(StageConfig(name="d", kind="diffusion", model=path))
    dummy = DiffusionStage(StageConfig(name="d", kind="diffusion", model=path, load_format="dummy"))
    real.load("cpu")
    dummy.load("cpu")
    real_params = dict(real.runtime.pipe.unet.named_parameters())
    dummy_params = dict(dummy.runtime.pipe.unet.named_parameters())
    assert real_params.keys() == dummy_params.keys()
    assert all(real_params[k].shape == dummy_params[k].shape for k in real_params)
    assert any(not (real_params[k] == dummy_params[k]).all() for k in real_params)
