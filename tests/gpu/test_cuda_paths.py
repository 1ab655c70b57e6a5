"""GPU paths of the speed options; skipped where CUDA is absent (CI). Timings live in bench/."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from vllm_omni_like.params import GenerationParams
from vllm_omni_like.pipelines import catalog
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.diffusion import acceleration as accel
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.wire import StageRequest

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _run(stage: DiffusionStage, seeds: list[int]) -> list[np.ndarray]:
    reqs = [
        StageRequest(f"r{s}", "a red circle", GenerationParams(seed=s, num_inference_steps=3))
        for s in seeds
    ]
    outs = stage.execute(reqs, StageControl(FaultInjector((), "diffusion")))
    return [o.images[0].pixels for o in outs]


@pytest.fixture(scope="module")
def sd15():
    (pipeline,) = catalog.resolve("sd15", load_format="dummy", dtype="fp16")
    stage = DiffusionStage(pipeline.stages[0])
    stage.load("cuda")
    return stage


def test_sd15_on_cuda_uses_the_fast_kernels_and_batches_match_singles(sd15):
    # eager: NCHW and cuDNN's heuristics (measured faster, see acceleration.py), fused QKV
    assert not sd15.runtime.speed.channels_last and sd15.runtime.speed.tuned == ["fused_qkv"]
    batched = _run(sd15, [1, 2, 3])
    for seed, image in zip([1, 2, 3], batched, strict=True):
        (alone,) = _run(sd15, [seed])
        mse = np.mean((alone.astype(float) - image.astype(float)) ** 2)
        assert mse == 0 or 10 * np.log10(255**2 / mse) >= 35  # fp16: PSNR >= 35 dB


def test_xformers_is_used_only_when_its_kernels_run(caplog, sd15):
    unet = sd15.runtime.pipe.unet
    before = dict(unet.attn_processors)
    with caplog.at_level(logging.WARNING):
        got = accel.set_attention(sd15.runtime.pipe, "xformers", torch.device("cuda"), "diffusion")
    problem = accel.xformers_problem(torch.device("cuda"))
    assert got == ("xformers" if problem is None else "sdpa")
    if problem is not None:  # the fallback leaves the (fused SDPA) processors as they were
        assert "falling back to PyTorch SDPA" in caplog.text
        assert all(unet.attn_processors[k] is p for k, p in before.items())
    unet.set_attn_processor(before)  # leave the module fixture as it was


def test_the_decode_on_the_side_stream_equals_the_pipelines_own(sd15):
    """`begin` leaves the latents on the main stream; `finish` decodes them on the side stream,
    from another thread (as the worker's finisher does) while the main stream runs on."""
    import threading

    assert sd15.runtime.side_stream is not None and sd15.config.decode_overlap
    control = StageControl(FaultInjector((), "diffusion"))
    reqs = [
        StageRequest(f"s{s}", "a red circle", GenerationParams(seed=s, num_inference_steps=3))
        for s in (4, 5)
    ]
    whole = [o.images[0].pixels for o in sd15.execute(reqs, control)]
    part = sd15.begin(reqs, control)
    got: list = []
    finisher = threading.Thread(target=lambda: got.extend(part.finish(reqs)))
    finisher.start()
    busy = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    for _ in range(20):  # the main stream keeps working meanwhile
        busy = (busy @ busy).clamp(-1, 1)
    finisher.join(60)
    torch.cuda.synchronize()
    for want, out in zip(whole, got, strict=True):
        assert np.array_equal(want, out.images[0].pixels)


def test_a_png_consumers_large_images_come_with_rows_filtered_on_the_device(sd15):
    """At 512x512 (the host's strip-pool size) on CUDA, an image a consumer encodes as PNG
    comes with its rows filtered on the device, png.filter_rows's bytes exactly; the encoder
    then deflates them into a PNG of the pixels."""
    import io

    from PIL import Image

    from vllm_omni_like.media import encode_image
    from vllm_omni_like.png import filter_rows

    control = StageControl(FaultInjector((), "diffusion"))
    params = GenerationParams(seed=3, num_inference_steps=2, width=512, height=512)
    png = StageRequest("p", "a red circle", params, encodes_png=True)
    jpeg = StageRequest("j", "a red circle", params)
    outs = {o.request_id: o for o in sd15.begin([png, jpeg], control).finish([png, jpeg])}
    image = outs["p"].images[0]
    assert outs["j"].images[0].scanlines is None and image.scanlines is not None
    assert np.array_equal(image.scanlines, filter_rows(image.pixels.reshape(512, -1), None, 3))
    data = encode_image(image.pixels, "png", None, image.scanlines)
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(data))), image.pixels)
