"""A diffusion batch split in two - denoising (`begin`), then decode (`finish`) - gives the
pipeline's own pixels, byte for byte, whole or in any subset (tiny models, in this process)."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_omni_like.config import StageConfig
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.wire import StageRequest

pytestmark = pytest.mark.slow


def _stage(model: str) -> DiffusionStage:
    stage = DiffusionStage(StageConfig(name="diffusion", kind="diffusion", model=model))
    stage.load("cpu")
    return stage


@pytest.fixture(scope="module")
def image_stage():
    stage = _stage("tiny-image")
    yield stage
    stage.close()


def _control() -> StageControl:
    return StageControl(FaultInjector((), "diffusion"))


def _pixels(outputs) -> dict[str, list[np.ndarray]]:
    found = {}
    for out in outputs:
        assert out.error is None
        frames = [out.video.frames] if out.video is not None else []
        found[out.request_id] = [img.pixels for img in out.images] + frames
    return found


def _seeds(outputs) -> dict[str, list[int]]:
    return {o.request_id: [img.seed for img in o.images] for o in outputs}


def _text2img() -> list[StageRequest]:
    return [
        StageRequest("a", "a red circle", GenerationParams(seed=3, n=2, num_inference_steps=3)),
        StageRequest("b", "a blue square", GenerationParams(seed=9, num_inference_steps=3)),
        StageRequest("c", "a green circle", GenerationParams(seed=4, num_inference_steps=3)),
    ]


def _assert_same(expected: dict, got: dict, levels: int = 0) -> None:
    """Equal pixels; `levels` > 0 where the decode ran at another batch size (a CPU
    convolution may block a batch of 1 differently from one of 4)."""
    assert expected.keys() == got.keys()
    for rid, images in expected.items():
        assert len(images) == len(got[rid])
        for want, have in zip(images, got[rid], strict=True):
            assert want.dtype == have.dtype == np.uint8 and want.shape == have.shape, rid
            assert np.abs(want.astype(int) - have.astype(int)).max() <= levels, rid


def test_the_split_batch_equals_the_pipeline_call(image_stage):
    rt = image_stage.runtime
    assert rt.adapter.decoder(rt.pipe) is not None  # the latent path runs
    batch = _text2img()
    whole = image_stage.execute(batch, _control())
    part = image_stage.begin(batch, _control())
    split = part.finish(batch)
    _assert_same(_pixels(whole), _pixels(split))
    assert _seeds(whole) == _seeds(split) == {"a": [3, 4], "b": [9], "c": [4]}
    # any subset, any number of times (the finisher bisects a failing decode)
    _assert_same({"b": _pixels(whole)["b"]}, _pixels(part.finish([batch[1]])), levels=1)
    tail = part.finish(batch[1:])
    _assert_same({k: _pixels(whole)[k] for k in ("b", "c")}, _pixels(tail), levels=1)


def test_a_compiled_decoder_gets_its_bucket_sizes(image_stage, monkeypatch):
    batch = _text2img()
    want = _pixels(image_stage.execute(batch, _control()))
    seen = []
    decoder = image_stage.runtime.adapter.decoder(image_stage.runtime.pipe)

    def recording(latents):
        seen.append(latents.shape[0])
        return decoder(latents)

    monkeypatch.setattr(image_stage.runtime.adapter, "decoder", lambda pipe: recording)
    monkeypatch.setattr(image_stage.runtime, "buckets", (1, 2, 4, 8))
    part = image_stage.begin(batch, _control())
    got = _pixels(part.finish([batch[0], batch[2]]))  # 3 rows, decoded as 4
    assert seen == [4]
    # the padding rows are decoded and dropped; the real rows keep their pixels
    _assert_same({k: want[k] for k in ("a", "c")}, got, levels=1)


def test_a_png_consumers_images_come_with_their_filtered_rows(image_stage, monkeypatch):
    """Where the stage filters (a GPU, large images: forced here), each image a consumer will
    encode as PNG comes with its rows filtered on the device, png.filter_rows's bytes exactly;
    the others without; the pixels do not change."""
    from vllm_omni_like.png import filter_rows
    from vllm_omni_like.stages.diffusion import vae_decode

    batch = _text2img()
    want = _pixels(image_stage.execute(batch, _control()))
    monkeypatch.setattr(vae_decode, "worth_filtering", lambda device, h, w: True)
    batch[0].encodes_png = batch[2].encodes_png = True
    part = image_stage.begin(batch, _control())
    outputs = part.finish(batch)
    _assert_same(want, _pixels(outputs))
    # then any subset again (the finisher's bisection): each call's own rows, or none
    outputs += part.finish([batch[1]]) + part.finish([batch[2]])
    for out in outputs:
        for image in out.images:
            if out.request_id == "b":
                assert image.scanlines is None
                continue
            rows = image.pixels.reshape(image.pixels.shape[0], -1)
            assert np.array_equal(image.scanlines, filter_rows(rows, None, 3)), out.request_id
    # nobody encodes PNG: no rows are filtered
    for r in batch:
        r.encodes_png = False
    outputs = image_stage.begin(batch, _control()).finish(batch)
    assert all(image.scanlines is None for out in outputs for image in out.images)


def test_a_pipeline_without_a_known_decode_decodes_in_its_call(image_stage, monkeypatch):
    batch = _text2img()
    monkeypatch.setattr(image_stage.runtime, "own", set())  # (our own loop always has its decoder)
    want = _pixels(image_stage.execute(batch, _control()))
    monkeypatch.setattr(image_stage.runtime.adapter, "decoder", lambda pipe: None)
    part = image_stage.begin(batch, _control())
    _assert_same(want, _pixels(part.finish(batch)))


def test_edits_split_the_same_way(image_stage):
    base = np.full((64, 64, 3), 200, dtype=np.uint8)
    mask = np.zeros((64, 64), dtype=np.uint8)
    mask[:, :32] = 255
    for name, pipe in image_stage.runtime.edit_pipes.items():
        assert image_stage.runtime.adapter.decoder(pipe) is not None, name
        params = GenerationParams(seed=5, num_inference_steps=4, strength=0.8)
        batch = [
            StageRequest(
                f"{name}{i}",
                "a blue square",
                params,
                mode="edit",
                images=[base],
                mask=mask if name == "inpaint" else None,
            )
            for i in range(2)
        ]
        whole = image_stage.execute(batch, _control())
        _assert_same(_pixels(whole), _pixels(image_stage.begin(batch, _control()).finish(batch)))


def test_video_splits_the_same_way():
    stage = _stage("tiny-video")
    try:
        assert stage.runtime.adapter.decoder(stage.runtime.pipe) is not None
        batch = [
            StageRequest(
                f"v{i}",
                "a red square moving left",
                GenerationParams(seed=i, num_inference_steps=3, num_frames=5),
                mode="text2video",
            )
            for i in range(2)
        ]
        whole = stage.execute(batch, _control())
        split = stage.begin(batch, _control()).finish(batch)
        _assert_same(_pixels(whole), _pixels(split))
        assert split[0].video.frames.shape == (5, 64, 64, 3)
    finally:
        stage.close()
