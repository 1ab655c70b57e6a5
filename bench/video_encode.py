"""Is the MP4 encode hidden behind the Wan VAE's decode, under each encoder? Prints a JSON line.

    python bench/video_encode.py                 # on a GPU: 832x480, 33 frames, bf16
    python bench/video_encode.py --device cpu --size 64x48 --frames 9   # a smoke run

The decode phase as the diffusion stage runs it (`stages/diffusion/vae_decode.py`): the VAE
decodes one video, its frames go to the host; with an encoder, `StreamedMP4` encodes each chunk
of frames while the next one decodes, and the phase ends when the MP4's bytes are whole. For each
setting (no encoder; imageio's ffmpeg; PyAV): the median of `--runs` after 2 warm-ups, and whether
every run's streamed MP4 equals that encoder's `encode_video` of the finished frames (and each
other). `encode_alone_s`: `encode_video` of the finished frames, what the overlap hides. Random
weights (the architecture's config), the same seeded latents for every setting.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator

import numpy as np
import torch
from diffusers import AutoencoderKLWan
from diffusers.video_processor import VideoProcessor

from vllm_omni_like import video_codec
from vllm_omni_like.stages.diffusion.video_stream import StreamedMP4
from vllm_omni_like.stages.torch_utils import tensor_to_uint8
from vllm_omni_like.video_codec import encode_video

HERE = os.path.dirname(os.path.abspath(__file__))
VAE = os.path.join(HERE, "..", "vllm_omni_like", "assets", "archs", "wan2.1-t2v-1.3b", "vae")
FPS = 16


@contextlib.contextmanager
def encoder(name: str) -> Iterator[None]:
    """PyAV encodes where imageio-ffmpeg cannot be imported (video_codec.VideoWriter._open)."""
    saved = sys.modules.get("imageio_ffmpeg", False)
    if name == "pyav":
        sys.modules["imageio_ffmpeg"] = None  # type: ignore[assignment]  # its import now fails
    try:
        yield
    finally:
        if saved is False:
            sys.modules.pop("imageio_ffmpeg", None)
        else:
            sys.modules["imageio_ffmpeg"] = saved  # type: ignore[assignment]


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def decode_phase(
    vae: AutoencoderKLWan, latents: torch.Tensor, stream: bool, frames: int
) -> tuple[float, float, np.ndarray, bytes | None]:
    """One decode phase: (seconds, seconds until the frames were on the host, the video's uint8
    frames FxHxWx3, the streamed MP4 or None)."""
    post = VideoProcessor(vae_scale_factor=8)
    sync(latents.device.type)
    t0 = time.perf_counter()
    with torch.inference_mode(), contextlib.ExitStack() as stack:
        mp4 = None
        if stream:
            mp4 = stack.enter_context(
                StreamedMP4((vae.decoder, vae.config.patch_size), [FPS], frames)
            )
        video = vae.decode(latents, return_dict=False)[0]
        pixels = tensor_to_uint8(post.postprocess_video(video, output_type="pt"))[0]
        decoded = time.perf_counter() - t0
    seconds = time.perf_counter() - t0
    return seconds, decoded, pixels, None if mp4 is None else mp4.result()[0].mp4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--frames", type=int, default=33)
    ap.add_argument("--size", default="832x480", help="WxH")
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--x264-avx512", action="store_true", help="PyAV's x264 with its AVX-512 code (as before)"
    )
    args = ap.parse_args()
    if args.x264_avx512:
        video_codec.pyav_x264_params = dict  # no options: x264 uses every flag the CPU has
    width, height = map(int, args.size.split("x"))
    torch.manual_seed(0)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    vae = AutoencoderKLWan.from_config(AutoencoderKLWan.load_config(VAE)).to(args.device, dtype)
    vae.eval()
    shape = (1, 16, (args.frames - 1) // 4 + 1, height // 8, width // 8)
    latents = torch.randn(shape, device=args.device, dtype=dtype)
    out: dict = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "cpus": os.cpu_count(),
        "video": f"{width}x{height}x{args.frames}",
        "pyav_x264_params": video_codec.pyav_x264_params(),
    }
    settings = [("none", "none"), ("pyav", "pyav")]
    if importlib.util.find_spec("imageio_ffmpeg") is not None:
        settings.insert(1, ("imageio-ffmpeg", "imageio-ffmpeg"))
    for name, which in settings:
        times, decodes, mp4s, alone, equal = [], [], set(), [], True
        with encoder(which):
            for i in range(2 + args.runs):
                seconds, decoded, pixels, mp4 = decode_phase(
                    vae, latents, name != "none", args.frames
                )
                if i < 2:
                    continue
                times.append(seconds)
                decodes.append(decoded)
                if mp4 is not None:
                    t0 = time.perf_counter()
                    whole = encode_video(pixels, FPS)
                    alone.append(time.perf_counter() - t0)
                    equal &= whole == mp4
                    mp4s.add(mp4)
        out[name] = {
            "decode_phase_s": round(statistics.median(times), 4),
            "frames_on_host_s": round(statistics.median(decodes), 4),
        }
        if name != "none":
            out[name].update(
                encode_alone_s=round(statistics.median(alone), 4),
                streamed_equals_encode_video=equal,
                distinct_mp4s=len(mp4s),
            )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
