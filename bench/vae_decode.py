"""The Wan VAE's decode of one video, with each kernel setting: prints a JSON line.

    python bench/vae_decode.py      # on a GPU: 832x480, 33 frames, bf16, random weights

Settings: diffusers' defaults; cuDNN autotuning (`cudnn.benchmark`); channels_last_3d weights;
both. Each: 2 warm-up decodes, then the median of `--runs`; the largest difference from the
default's frames, in 8-bit levels.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from diffusers import AutoencoderKLWan

HERE = os.path.dirname(os.path.abspath(__file__))
VAE = os.path.join(HERE, "..", "vllm_omni_like", "assets", "archs", "wan2.1-t2v-1.3b", "vae")


def decode_s(vae: AutoencoderKLWan, latents: torch.Tensor, runs: int) -> tuple[float, torch.Tensor]:
    times = []
    for i in range(2 + runs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            video = vae.decode(latents, return_dict=False)[0]
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), video


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--frames", type=int, default=33)
    args = ap.parse_args()
    torch.manual_seed(0)
    vae = AutoencoderKLWan.from_config(AutoencoderKLWan.load_config(VAE))
    vae = vae.to("cuda", torch.bfloat16).eval()
    latent_frames = (args.frames - 1) // 4 + 1
    latents = torch.randn(1, 16, latent_frames, 60, 104, device="cuda", dtype=torch.bfloat16)
    out: dict = {"device": torch.cuda.get_device_name(), "frames": args.frames}
    base = None
    for name, bench, layout in (
        ("default", False, torch.contiguous_format),
        ("cudnn_benchmark", True, torch.contiguous_format),
        ("channels_last_3d", False, torch.channels_last_3d),
        ("both", True, torch.channels_last_3d),
    ):
        torch.backends.cudnn.benchmark = bench
        for module in vae.modules():  # (`vae.to(memory_format=...)` wants every weight 5-D)
            if isinstance(module, torch.nn.Conv3d):
                module.weight.data = module.weight.data.contiguous(memory_format=layout)
        seconds, video = decode_s(vae, latents.contiguous(memory_format=layout), args.runs)
        levels = video.float().clamp(-1, 1).add(1).mul(127.5).round()
        base = levels if base is None else base
        out[name] = {
            "decode_s": round(seconds, 4),
            "max_diff_levels": int((levels - base).abs().max().item()),
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
