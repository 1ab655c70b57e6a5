"""PyAV's libx264 options: its assembly capped at AVX2 on a CPU with AVX-512 (where the capped
x264 is repeatable: video_codec.py), left to x264 elsewhere."""

from __future__ import annotations

import sys

import numpy as np

from vllm_omni_like import video_codec
from vllm_omni_like.video_codec import VideoWriter, decode_video, encode_video

AVX512_HOST = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 avx512f avx512bw avx512vl\n\n"
AVX2_HOST = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma bmi2\n\n"


def test_x264_is_capped_at_avx2_only_where_the_cpu_has_avx512(tmp_path):
    for name, text, want in (
        ("avx512", AVX512_HOST, {"x264-params": "asm=AVX2"}),
        ("avx2", AVX2_HOST, {}),
    ):
        path = tmp_path / name
        path.write_text(text)
        assert video_codec.pyav_x264_params(str(path)) == want
    assert video_codec.pyav_x264_params(str(tmp_path / "missing")) == {}


def test_the_pyav_writer_hands_x264_its_params(tmp_path, monkeypatch):
    """What `pyav_x264_params` says reaches x264 (which writes its settings into the stream),
    and the cap encodes the same bytes whole or frame by frame."""
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # PyAV encodes
    frames = np.random.default_rng(0).integers(0, 256, (5, 32, 48, 3), dtype=np.uint8)
    assert b" keyint=250 " in encode_video(frames, 8)  # x264's default
    monkeypatch.setattr(video_codec, "pyav_x264_params", lambda: {"x264-params": "keyint=17"})
    assert b" keyint=17 " in encode_video(frames, 8)
    monkeypatch.setattr(video_codec, "pyav_x264_params", lambda: {"x264-params": "asm=AVX2"})
    writer = VideoWriter(str(tmp_path / "v.mp4"), 8)
    for frame in frames:
        writer.append(frame[None])
    writer.close()
    with open(tmp_path / "v.mp4", "rb") as f:
        data = f.read()
    assert data == encode_video(frames, 8)
    assert decode_video(data).shape == frames.shape
