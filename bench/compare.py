"""Comparing the server's media with the reference's (docs/benchmarks.md: PSNR >= 35 dB)."""

from __future__ import annotations

import math

import numpy as np

PSNR_MIN_DB = 35.0


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def db(value: float) -> float | str:
    return "inf" if value == math.inf else round(value, 2)
