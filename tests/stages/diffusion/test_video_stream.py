"""A video's MP4 encoded while its VAE decodes (stages/diffusion/video_stream.py): chunk by
chunk, the same bytes as encoding the finished frames, and a failed encode leaves the frames to
the API."""

from __future__ import annotations

import importlib.util
import logging
import os
import sys

import numpy as np
import pytest
import torch

from vllm_omni_like.config import StageConfig
from vllm_omni_like.media import encode_image
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.diffusion import video_stream
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.video_codec import VideoBytes, VideoWriter, decode_video, encode_video
from vllm_omni_like.wire import StageRequest

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True, params=["imageio-ffmpeg", "pyav"])
def encoder(request, monkeypatch):
    """Every test under both encoders: imageio's ffmpeg, and PyAV where imageio-ffmpeg is
    missing (each streamed MP4 is compared with its own encoder's `encode_video`)."""
    if request.param == "pyav":
        monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # its import now fails
    elif importlib.util.find_spec("imageio_ffmpeg") is None:  # (a GPU machine may lack it)
        if os.environ.get("CI") == "true":
            pytest.fail("imageio-ffmpeg is not installed (a dependency of the package)")
        pytest.skip("imageio-ffmpeg is not installed: PyAV alone encodes here")
    used: list[str] = []
    real_open = VideoWriter._open

    def spy(self, size):
        real_open(self, size)
        used.append("pyav" if self._av is not None else "imageio-ffmpeg")

    monkeypatch.setattr(VideoWriter, "_open", spy)
    yield request.param
    assert set(used) <= {request.param}, used  # every video of the test went through it


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# on CUDA each chunk goes to the host through pinned memory and an event, off the side stream
@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=CUDA)])
def video_stage(request):
    stage = DiffusionStage(StageConfig(name="diffusion", kind="diffusion", model="tiny-video"))
    stage.load(request.param)
    yield stage
    stage.close()


def _batch(files_only: bool = False) -> list[StageRequest]:
    """Two clips of 9 frames: the first latent frame decodes to one frame, each later one to
    the VAE's temporal ratio of frames (4 in Wan2.1, 2 in the tiny model)."""
    return [
        StageRequest(
            f"v{i}",
            "a red square moving left",
            GenerationParams(seed=i, num_inference_steps=2, num_frames=9, fps=fps),
            mode="text2video",
            files_only=files_only,
        )
        for i, fps in enumerate((8, 12))
    ]


def _run(stage: DiffusionStage, files_only: bool = False):
    batch = _batch(files_only)
    return stage.begin(batch, StageControl(FaultInjector((), "diffusion"))).finish(batch)


def test_each_clip_is_encoded_chunk_by_chunk_to_the_bytes_of_its_finished_frames(
    video_stage, monkeypatch
):
    appends: dict[int, list[int]] = {}
    append = VideoBytes.append

    def spy(self, frames):
        appends.setdefault(id(self), []).append(len(frames))
        append(self, frames)

    monkeypatch.setattr(VideoBytes, "append", spy)
    outs = _run(video_stage)
    ratio = video_stage.runtime.pipe.vae_scale_factor_temporal
    chunks = [1] + [ratio] * (8 // ratio)  # as the decoder made them
    assert len(chunks) > 2 and list(appends.values()) == [chunks, chunks]
    for out, fps in zip(outs, (8, 12), strict=True):
        video = out.video
        assert video.frames.shape == (9, 64, 64, 3) and video.fps == fps
        assert video.mp4 is not None and video.mp4 == encode_video(video.frames, fps)
        assert decode_video(video.mp4).shape == (9, 64, 64, 3)
        # the thumbnail the videos API stores, encoded as its frame went by
        assert video.thumbnail is not None and video.thumbnail == encode_image(video.frames[4])
    assert not np.array_equal(outs[0].video.frames, outs[1].video.frames)


def test_a_request_for_files_only_gets_them_without_its_frames(video_stage, monkeypatch):
    """A video job keeps the MP4 and the thumbnail: its frames stay in the worker; if the
    stage could not encode, they come (the API encodes them)."""
    want = _run(video_stage)
    outs = _run(video_stage, files_only=True)
    for have, full in zip(outs, want, strict=True):
        assert have.video.frames is None and have.video.shape == (9, 64, 64)
        assert have.video.mp4 == full.video.mp4 and have.video.thumbnail == full.video.thumbnail
    monkeypatch.setattr(VideoBytes, "append", lambda self, frames: 1 / 0)
    outs = _run(video_stage, files_only=True)
    for have, full in zip(outs, want, strict=True):
        assert have.video.mp4 is None and np.array_equal(have.video.frames, full.video.frames)
        assert have.video.shape == (9, 64, 64)


def test_a_failed_encode_leaves_the_frames_to_the_api(video_stage, monkeypatch, caplog):
    want = [o.video.frames for o in _run(video_stage)]

    def broken(self, frames):
        raise OSError("ffmpeg: broken pipe")

    monkeypatch.setattr(VideoBytes, "append", broken)
    with caplog.at_level(logging.WARNING, logger=video_stream.__name__):
        outs = _run(video_stage)
    assert [o.video.mp4 for o in outs] == [None, None]
    assert [o.video.thumbnail for o in outs] == [None, None]  # the API makes both
    for have, frames in zip(outs, want, strict=True):
        assert np.array_equal(have.video.frames, frames)
    assert "streamed MP4 encode failed (ffmpeg: broken pipe)" in caplog.text


def test_a_video_of_other_than_the_expected_frames_gets_no_thumbnail(video_stage, monkeypatch):
    """The stage expects the frames asked for; a pipeline that makes another count (Wan rounds
    num_frames to 4k + 1) leaves the thumbnail to the API rather than store the wrong frame."""
    made = []
    init = video_stream.StreamedMP4.__init__

    def expect_more(self, source, fps, frames=0):
        made.append(frames)
        init(self, source, fps, frames + 4)

    monkeypatch.setattr(video_stream.StreamedMP4, "__init__", expect_more)
    outs = _run(video_stage)
    assert made == [9]
    assert [o.video.thumbnail for o in outs] == [None, None]
    assert all(o.video.mp4 == encode_video(o.video.frames, o.video.fps) for o in outs)


def test_only_an_untiled_wan_decoder_streams(video_stage):
    source = video_stage.runtime.adapter.chunk_source()
    assert source is not None and source.module is video_stage.runtime.pipe.vae.decoder
    video_stage.runtime.pipe.vae.enable_tiling()
    try:
        assert video_stage.runtime.adapter.chunk_source() is None  # it decodes tile by tile
    finally:
        video_stage.runtime.pipe.vae.disable_tiling()
