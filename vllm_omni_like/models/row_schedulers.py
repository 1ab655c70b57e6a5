"""Schedulers with per-row state, stepped for a whole batch at once (the denoising loop's).

A row carries its own schedule: its scheduler, its step count and where it is in it. The
schedule's tables (timesteps, sigmas, cumulative alphas) are the diffusers scheduler's own,
made once per (scheduler config, steps) on the host with `set_timesteps`; a batch's update is
one vectorised computation over per-row coefficients gathered on the host from those tables
(float32, as diffusers computes them) and applied on the device as (B, 1, ..., 1) tensors, in
the same order of operations as the scheduler's `step`, so each row's result is the one a
pipeline running that row alone computes. Never one `step()` call per row.

Kinds: DDIM, Euler and Euler ancestral (whose noise comes from each row's own generator) for
the UNet family; flow-match Euler for Wan. The denoising loop of our own (#33) steps with these;
DPM-Solver++ 2M and UniPC (multistep: per-row history) join it there.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Schedule:
    """One (scheduler, steps) pair's tables, shared by every row that runs it."""

    kind: str
    steps: int
    timesteps: torch.Tensor  # what the denoiser is given at each step (host, float32)
    sigmas: torch.Tensor | None  # Euler / flow-match: steps + 1 values (host, float32)
    alphas_cumprod: torch.Tensor | None  # DDIM (host, float32)
    final_alpha_cumprod: float | None
    step_ratio: int | None
    init_noise_sigma: float


@dataclass
class Row:
    """A row's place in its schedule."""

    schedule: Schedule
    index: int = 0
    generator: torch.Generator | None = None  # an ancestral step's noise

    @property
    def timestep(self) -> torch.Tensor:
        return self.schedule.timesteps[self.index]

    @property
    def done(self) -> bool:
        return self.index >= self.schedule.steps


KINDS = {
    "DDIMScheduler": "ddim",
    "EulerDiscreteScheduler": "euler",
    "EulerAncestralDiscreteScheduler": "euler-a",
    "FlowMatchEulerDiscreteScheduler": "flow-euler",
}


@functools.lru_cache(maxsize=256)
def _schedule(class_name: str, config_json: str, steps: int) -> Schedule:
    import diffusers

    scheduler = getattr(diffusers, class_name).from_config(json.loads(config_json))
    scheduler.set_timesteps(steps, device="cpu")
    kind = KINDS[class_name]
    sigmas = getattr(scheduler, "sigmas", None) if kind != "ddim" else None
    alphas = scheduler.alphas_cumprod if kind == "ddim" else None
    return Schedule(
        kind=kind,
        steps=steps,
        timesteps=scheduler.timesteps.to(torch.float32),
        sigmas=None if sigmas is None else sigmas.to(torch.float32),
        alphas_cumprod=alphas,
        final_alpha_cumprod=float(scheduler.final_alpha_cumprod) if kind == "ddim" else None,
        step_ratio=scheduler.config.num_train_timesteps // steps if kind == "ddim" else None,
        init_noise_sigma=float(getattr(scheduler, "init_noise_sigma", 1.0)),
    )


def schedule_for(scheduler: Any, steps: int) -> Schedule:
    """The tables of `scheduler`'s class and config at `steps` steps (cached)."""
    name = type(scheduler).__name__
    if name not in KINDS:
        raise ValueError(f"no batched steps for {name}; these have: {', '.join(KINDS)}")
    config = json.dumps(dict(scheduler.config), sort_keys=True, default=str)
    return _schedule(name, config, steps)


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    shape = (len(values),) + (1,) * (like.dim() - 1)
    return torch.tensor(values, dtype=torch.float32).view(shape).to(like.device)


def scale_input(rows: Sequence[Row], latents: torch.Tensor) -> torch.Tensor:
    """The denoiser's input for each row (Euler divides by sqrt(sigma^2 + 1))."""
    if all(r.schedule.kind not in EULERS for r in rows):
        return latents
    scale = [
        float((r.schedule.sigmas[r.index] ** 2 + 1) ** 0.5) if r.schedule.kind in EULERS else 1.0
        for r in rows
    ]
    return latents / _column(scale, latents).to(latents.dtype)


def step(rows: Sequence[Row], output: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
    """Every row one step on: its scheduler's update of `latents` by the denoiser's `output`
    (epsilon for DDIM and Euler, velocity for flow-match), each with its own coefficients."""
    kinds = {r.schedule.kind for r in rows}
    if len(kinds) == 1:
        out = _STEPS[kinds.pop()](rows, output, latents)
    else:  # rows of several kinds: each kind's rows together, put back in place
        out = torch.empty_like(latents)
        for kind in kinds:
            picked = [i for i, r in enumerate(rows) if r.schedule.kind == kind]
            index = torch.tensor(picked, device=latents.device)
            part = _STEPS[kind]([rows[i] for i in picked], output[index], latents[index])
            out[index] = part
    for r in rows:
        r.index += 1
    return out


def _ddim(rows: Sequence[Row], eps: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """DDIMScheduler.step with eta 0, epsilon prediction, no clipping."""
    alpha, alpha_prev = [], []
    for r in rows:
        s = r.schedule
        t = int(s.timesteps[r.index])
        prev = t - s.step_ratio
        alpha.append(float(s.alphas_cumprod[t]))
        alpha_prev.append(float(s.alphas_cumprod[prev]) if prev >= 0 else s.final_alpha_cumprod)
    a = _column(alpha, sample)
    a_prev = _column(alpha_prev, sample)
    beta = 1 - a
    x0 = (sample - beta ** (0.5) * eps) / a ** (0.5)
    direction = (1 - a_prev) ** (0.5) * eps
    return a_prev ** (0.5) * x0 + direction


def _euler(rows: Sequence[Row], eps: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """EulerDiscreteScheduler.step without churn, epsilon prediction (in float32)."""
    sigma = _column([float(r.schedule.sigmas[r.index]) for r in rows], sample)
    nxt = _column([float(r.schedule.sigmas[r.index + 1]) for r in rows], sample)
    x = sample.to(torch.float32)
    x0 = x - sigma * eps
    derivative = (x - x0) / sigma
    return (x + derivative * (nxt - sigma)).to(eps.dtype)


def _euler_ancestral(rows: Sequence[Row], eps: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """EulerAncestralDiscreteScheduler.step, epsilon prediction (in float32): each row's noise
    from its own generator, as a pipeline's list of generators draws it."""
    sigma, up, down = [], [], []
    for r in rows:
        s_from, s_to = r.schedule.sigmas[r.index], r.schedule.sigmas[r.index + 1]
        sigma_up = (s_to**2 * (s_from**2 - s_to**2) / s_from**2) ** 0.5  # float32, as diffusers
        sigma.append(float(s_from))
        up.append(float(sigma_up))
        down.append(float((s_to**2 - sigma_up**2) ** 0.5))
    s, s_up, s_down = (_column(v, sample) for v in (sigma, up, down))
    x = sample.to(torch.float32)
    x0 = x - s * eps
    derivative = (x - x0) / s
    out = x + derivative * (s_down - s)
    from diffusers.utils.torch_utils import randn_tensor

    row = (1, *eps.shape[1:])  # (a pipeline's list of generators: one draw of a row's shape each)
    noise = torch.cat(
        [randn_tensor(row, generator=r.generator, device=eps.device, dtype=eps.dtype) for r in rows]
    )
    return (out + noise * s_up).to(eps.dtype)


def _flow_euler(rows: Sequence[Row], v: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """FlowMatchEulerDiscreteScheduler.step (in float32)."""
    sigma = _column([float(r.schedule.sigmas[r.index]) for r in rows], sample)
    nxt = _column([float(r.schedule.sigmas[r.index + 1]) for r in rows], sample)
    x = sample.to(torch.float32)
    return (x + (nxt - sigma) * v).to(v.dtype)


EULERS = ("euler", "euler-a")
_STEPS = {"ddim": _ddim, "euler": _euler, "euler-a": _euler_ancestral, "flow-euler": _flow_euler}
