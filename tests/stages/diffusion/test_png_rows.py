"""PNG's row filters on the device (a GPU stage's, run here on the CPU's torch): the same
bytes as the host's encoder makes (png.filter_rows)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni_like.png import MIN_PIXELS, filter_rows
from vllm_omni_like.stages.diffusion.png_rows import filter_scanlines, worth_filtering


@pytest.mark.parametrize("shape", [(2, 33, 17, 3), (1, 64, 80, 4), (1, 5, 7, 1), (1, 9, 11, 2)])
@pytest.mark.parametrize("kind", ["noise", "flat", "ramps"])
def test_the_device_filters_as_the_host_does(shape: tuple[int, ...], kind: str) -> None:
    rng = np.random.default_rng(sum(shape))
    if kind == "noise":
        images = rng.integers(0, 256, shape, dtype=np.uint8)
    elif kind == "flat":  # every filter's cost ties: the first of them wins
        images = np.full(shape, 7, np.uint8)
    else:  # smooth ramps with a little noise: Paeth, Average and Up all get chosen
        yy, xx = np.mgrid[0 : shape[1], 0 : shape[2]]
        base = (xx * 3 + yy * 5)[None, :, :, None] + rng.integers(-3, 4, shape)
        images = np.clip(base, 0, 255).astype(np.uint8)
    got = filter_scanlines(torch.from_numpy(images)).numpy()
    assert got.dtype == np.uint8 and got.shape == (shape[0], shape[1], 1 + shape[2] * shape[3])
    for b in range(shape[0]):
        want = filter_rows(images[b].reshape(shape[1], -1), None, shape[3])
        assert np.array_equal(got[b], want)
    if kind == "ramps":
        assert len(set(got[..., 0].ravel().tolist())) > 1  # (not one filter for every row)


def test_only_a_gpu_filters_and_only_large_images() -> None:
    side = int(MIN_PIXELS**0.5)
    assert worth_filtering(torch.device("cuda", 0), side, side)
    assert not worth_filtering(torch.device("cuda", 0), side - 1, side)
    assert not worth_filtering(torch.device("cpu"), 4 * side, 4 * side)
