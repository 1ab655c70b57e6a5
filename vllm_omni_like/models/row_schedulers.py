"""Schedulers with per-row state, stepped for a whole batch at once (the denoising loop's).

A row carries its own schedule: its scheduler, its step count and where it is in it. The
schedule's tables (timesteps, sigmas, cumulative alphas) are the diffusers scheduler's own,
made once per (scheduler config, steps) on the host with `set_timesteps`; a batch's update is
one vectorised computation over per-row coefficients gathered on the host from those tables
(float32, as diffusers computes them) and applied on the device as (B, 1, ..., 1) tensors, in
the same order of operations as the scheduler's `step`, so each row's result is the one a
pipeline running that row alone computes. Never one `step()` call per row.

Kinds: DDIM, Euler and Euler ancestral (whose noise comes from each row's own generator) and
flow-match Euler, each by its own code here; DPM-Solver++, UniPC and PNDM ("multistep": a
history per row) by models/multistep.py, the same way. The names a request gives
(`scheduler`) are models/schedulers.py's.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_omni_like.models import multistep
from vllm_omni_like.models.schedulers import EXPLICIT, MULTISTEP, SCHEDULERS, unsupported


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
    tables: multistep.Tables | None = None  # multistep: each step's variant and scalars

    @property
    def iterations(self) -> int:
        """Denoiser calls (PNDM makes one more than its steps)."""
        return len(self.timesteps)


@dataclass
class Row:
    """A row's place in its schedule."""

    schedule: Schedule
    index: int = 0
    generator: torch.Generator | None = None  # an ancestral step's noise
    history: dict[str, torch.Tensor] = field(default_factory=dict)  # multistep: its past

    @property
    def timestep(self) -> torch.Tensor:
        return self.schedule.timesteps[self.index]

    @property
    def done(self) -> bool:
        return self.index >= self.schedule.iterations


KINDS = {
    "DDIMScheduler": "ddim",
    "EulerDiscreteScheduler": "euler",
    "EulerAncestralDiscreteScheduler": "euler-a",
    "FlowMatchEulerDiscreteScheduler": "flow-euler",
    **{name: "multistep" for name in MULTISTEP},
}
assert set(KINDS) == set(EXPLICIT + MULTISTEP)


def make_scheduler(name: str, config: dict[str, Any]) -> Any:
    """The diffusers scheduler a request's `scheduler` name stands for, built from the model's
    own scheduler config."""
    import diffusers

    class_name, overrides = SCHEDULERS[name]
    return getattr(diffusers, class_name).from_config(dict(config), **overrides)


@functools.lru_cache(maxsize=256)
def _schedule(class_name: str, config_json: str, steps: int) -> Schedule:
    import diffusers

    scheduler = getattr(diffusers, class_name).from_config(json.loads(config_json))
    scheduler.set_timesteps(steps, device="cpu")
    kind = KINDS[class_name]
    tables = multistep.tables(scheduler) if kind == "multistep" else None
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
        tables=tables,
    )


def schedule_for(scheduler: Any, steps: int) -> Schedule:
    """The tables of `scheduler`'s class and config at `steps` steps (cached)."""
    name = type(scheduler).__name__
    problem = unsupported(name, dict(scheduler.config))
    if problem is not None:
        raise ValueError(f"no batched steps for {problem}; these have them: {', '.join(KINDS)}")
    config = json.dumps(dict(scheduler.config), sort_keys=True, default=str)
    return _schedule(name, config, steps)


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    shape = (len(values),) + (1,) * (like.dim() - 1)
    return multistep.to_device(torch.tensor(values, dtype=torch.float32).view(shape), like.device)


def scale_input(rows: Sequence[Row], latents: torch.Tensor) -> torch.Tensor:
    """The denoiser's input for each row (Euler divides by sqrt(sigma^2 + 1))."""
    if all(r.schedule.kind not in EULERS for r in rows):
        return latents
    scale = [
        float((r.schedule.sigmas[r.index] ** 2 + 1) ** 0.5) if r.schedule.kind in EULERS else 1.0
        for r in rows
    ]
    return (latents / _column(scale, latents)).to(latents.dtype)  # (as a 0-dim sigma: in fp32)


def step(rows: Sequence[Row], output: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
    """Every row one step on: its scheduler's update of `latents` by the denoiser's `output`
    (epsilon for DDIM and Euler, velocity for flow-match; a multistep scheduler's prediction
    type is its config's), each with its own coefficients. In the dtype its scheduler leaves
    the sample in."""
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):  # (a multistep scheduler's rows by what their step does)
        tables = r.schedule.tables
        key = multistep.variant((tables, r.index)) if tables else (r.schedule.kind,)
        groups.setdefault(key, []).append(i)
    if len(groups) == 1:
        out = _STEPS[rows[0].schedule.kind](rows, output, latents)
    else:  # rows of several kinds: each kind's rows together, put back in place (a row's
        # values are those its kind left, in a dtype that holds every kind's exactly)
        dtype = torch.promote_types(latents.dtype, output.dtype)
        out = torch.empty_like(latents, dtype=dtype)
        for picked in groups.values():
            index = multistep.to_device(torch.tensor(picked), latents.device)
            kind = rows[picked[0]].schedule.kind
            part = _STEPS[kind]([rows[i] for i in picked], output[index], latents[index])
            out[index] = part.to(dtype)
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
    return (a_prev ** (0.5) * x0 + direction).to(torch.promote_types(sample.dtype, eps.dtype))


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


def _multistep(rows: Sequence[Row], output: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    positions = [(r.schedule.tables, r.index) for r in rows]
    return multistep.step(positions, [r.history for r in rows], output, sample)


EULERS = ("euler", "euler-a")
_STEPS = {
    "ddim": _ddim,
    "euler": _euler,
    "euler-a": _euler_ancestral,
    "flow-euler": _flow_euler,
    "multistep": _multistep,
}
