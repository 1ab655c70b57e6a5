"""Schedulers with per-row state, stepped for a whole batch at once (the denoising loop's).

A row carries its own schedule: its scheduler, its step count and where it is in it. Each
schedule's per-step scalars (sigmas, alphas and what its step derives from them) are computed
once per (scheduler config, steps) on the host from the diffusers scheduler's own tables, each
as diffusers computes it (float32 0-dim operations), and kept with the schedule (`Tables`). A
batch's update gathers each row's scalars (models/columns.py: one 0-dim scalar where all rows
agree, else a float32 column) and applies them in the order of operations of the scheduler's
`step`, so each row's result is the one a pipeline running that row alone computes. Rows whose
steps do different things (another kind, another solver order) step as separate groups; never
one `step()` call per row, and no step waits on the device.

Kinds: DDIM, Euler and Euler ancestral (whose noise comes from each row's own generator) and
flow-match Euler here; DPM-Solver++ (and its SDE), UniPC and PNDM (a history per row) in
models/multistep.py and models/pndm.py.
The names a request gives (`scheduler`) are models/schedulers.py's.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_omni_like.models import multistep
from vllm_omni_like.models.columns import Cols, div, mul, to_device
from vllm_omni_like.models.multistep import Tables
from vllm_omni_like.models.schedulers import EXPLICIT, MULTISTEP, SCHEDULERS, unsupported


@dataclass(frozen=True)
class Schedule:
    """One (scheduler, steps) pair's tables, shared by every row that runs it."""

    kind: str
    steps: int
    timesteps: torch.Tensor  # what the denoiser is given at each step (host, float32)
    tables: Tables  # each step's variant and scalars
    init_noise_sigma: float
    start: int = 0  # where in the scheduler's whole schedule it begins (image-to-image)
    # the diffusers scheduler, its timesteps set: its tables noise an edit row's source as the
    # pipeline's scheduler does (`noise_to`)
    noiser: Any = field(default=None, compare=False, repr=False)
    _on_device: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    def noiser_on(self, device: torch.device) -> Any:
        """The noiser with its tables on `device` (copied there once): noising on a device
        then copies nothing from the host, so it never waits for the device."""
        key = ("noiser", device)
        if key not in self._on_device:
            noiser = copy.deepcopy(self.noiser)
            for name in ("timesteps", "sigmas", "alphas_cumprod"):
                value = getattr(noiser, name, None)
                if isinstance(value, torch.Tensor):
                    setattr(noiser, name, to_device(value, device))
            self._on_device[key] = noiser
        return self._on_device[key]

    @property
    def iterations(self) -> int:
        """Denoiser calls (PNDM makes one more than its steps)."""
        return len(self.timesteps)

    def timesteps_on(self, device: torch.device) -> torch.Tensor:
        """The timesteps on `device`, copied there once (from pinned memory: a copy from
        pageable memory waits for the device - a request's first step would)."""
        if device not in self._on_device:
            self._on_device[device] = to_device(self.timesteps, device)
        timesteps: torch.Tensor = self._on_device[device]
        return timesteps


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
def _schedule(
    class_name: str, config_json: str, steps: int, args_json: str, start: int
) -> Schedule:
    import diffusers

    scheduler = getattr(diffusers, class_name).from_config(json.loads(config_json))
    scheduler.set_timesteps(steps, device="cpu", **json.loads(args_json))
    kind = KINDS[class_name]
    if kind == "multistep":
        tables = multistep.tables(scheduler, start)
    else:
        whole = _explicit(scheduler, kind)
        tables = Tables(kind, whole.variants[start:], whole.scalars[start:])
    return Schedule(
        kind=kind,
        steps=steps,
        timesteps=scheduler.timesteps[start:].to(torch.float32),
        tables=tables,
        init_noise_sigma=float(getattr(scheduler, "init_noise_sigma", 1.0)),
        start=start,
        noiser=scheduler,
    )


def schedule_for(
    scheduler: Any, steps: int, args: dict[str, Any] | None = None, start: int = 0
) -> Schedule:
    """The tables of `scheduler`'s class and config at `steps` steps (cached); `args`: what
    else the pipeline gives its `set_timesteps` (FLUX.1: its sigmas, and the shift `mu` of
    the image's length where the schedule shifts with it); `start`: the step an image-to-image
    row begins at (the schedule is the whole one's from there)."""
    name = type(scheduler).__name__
    problem = unsupported(name, dict(scheduler.config))
    if problem is not None:
        raise ValueError(f"no batched steps for {problem}; these have them: {', '.join(KINDS)}")
    config = json.dumps(dict(scheduler.config), sort_keys=True, default=str)
    return _schedule(name, config, steps, json.dumps(args or {}, sort_keys=True), start)


def add_noise(schedule: Schedule, source: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Rows of an image's latents (`source`) noised to their schedule's first step, as an
    image-to-image pipeline noises them before its loop."""
    return noise_to(schedule, 0, source, noise)


def noise_to(
    schedule: Schedule, index: int, source: torch.Tensor, noise: torch.Tensor
) -> torch.Tensor:
    """`source` noised with `noise` to the schedule's step `index`, by its scheduler's maths
    at that step (where the pipeline's scheduler, stepped that far, noises: an inpainting
    pipeline's image after each step). A sigma schedule's sigma is a slice of its table on the
    device (diffusers' `add_noise` indexes it with a list, a copy from the host that waits for
    the device), then its `scale_noise` (flow matching), its `add_noise` from alpha and sigma
    (DPM-Solver, UniPC) or from sigma (Euler); the others' `add_noise` itself (an index on the
    device)."""
    noiser = schedule.noiser_on(source.device)
    at = schedule.start + index
    sigmas = getattr(noiser, "sigmas", None)
    if isinstance(sigmas, torch.Tensor):  # (DDIM and PNDM have none: alphas, by timestep)
        shape = (1,) * source.dim()
        sigma = sigmas.to(dtype=source.dtype)[at : at + 1].reshape(shape)
        if hasattr(noiser, "scale_noise"):
            return sigma * noise + (1.0 - sigma) * source
        if hasattr(noiser, "_sigma_to_alpha_sigma_t"):
            alpha_t, sigma_t = noiser._sigma_to_alpha_sigma_t(sigma)
            mixed: torch.Tensor = alpha_t * source + sigma_t * noise
            return mixed
        return source + noise * sigma
    first = noiser.timesteps[at : at + 1].repeat(source.shape[0])
    noised: torch.Tensor = noiser.add_noise(source, noise, first)
    return noised


# ---- the scalars of the kinds stepped here, as diffusers computes them ----------------------
def _explicit(s: Any, kind: str) -> Tables:
    scalars = []
    for i, t in enumerate(s.timesteps):
        if kind == "ddim":  # DDIMScheduler.step, eta 0
            prev = int(t) - s.config.num_train_timesteps // s.num_inference_steps
            alpha = s.alphas_cumprod[int(t)]
            alpha_prev = s.alphas_cumprod[prev] if prev >= 0 else s.final_alpha_cumprod
            beta = 1 - alpha
            row = {
                "beta_sqrt": beta ** (0.5),
                "alpha_sqrt": alpha ** (0.5),
                "direction": (1 - alpha_prev - torch.tensor(0.0) ** 2) ** (0.5),
                "alpha_prev_sqrt": alpha_prev ** (0.5),
            }
        else:
            sigma, nxt = s.sigmas[i], s.sigmas[i + 1]
            row = {"sigma": sigma, "c_in": (sigma**2 + 1) ** 0.5}
            if kind == "euler-a":
                up = (nxt**2 * (sigma**2 - nxt**2) / sigma**2) ** 0.5
                row.update(up=up, dt=(nxt**2 - up**2) ** 0.5 - sigma)
            else:  # Euler (no churn: sigma_hat = sigma), flow-match Euler
                row["dt"] = nxt - sigma
        scalars.append({k: float(v) for k, v in row.items()})
    return Tables(kind, tuple((kind,) for _ in scalars), tuple(scalars))


EULERS = ("euler", "euler-a")


def scale_input(rows: Sequence[Row], latents: torch.Tensor) -> torch.Tensor:
    """The denoiser's input for each row (Euler divides by sqrt(sigma^2 + 1))."""
    if all(r.schedule.kind not in EULERS for r in rows):
        return latents
    scalars = [
        r.schedule.tables.scalars[r.index] if r.schedule.kind in EULERS else {"c_in": 1.0}
        for r in rows
    ]
    return div(latents, Cols(scalars, latents)["c_in"])


def timesteps(rows: Sequence[Row], device: torch.device) -> torch.Tensor:
    """Each row's timestep on `device`: a view of its schedule's where all rows share one
    (no copy), else gathered on the host and copied without waiting."""
    first = rows[0]
    if all(r.schedule is first.schedule and r.index == first.index for r in rows):
        return first.schedule.timesteps_on(device)[first.index].expand(len(rows))
    return to_device(torch.stack([r.timestep for r in rows]), device)


def step(rows: Sequence[Row], output: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
    """Every row one step on: its scheduler's update of `latents` by the denoiser's `output`
    (epsilon for DDIM and Euler, velocity for flow-match; a multistep scheduler's prediction
    type is its config's), each with its own scalars. In the dtype its scheduler leaves the
    sample in."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, r in enumerate(rows):  # by what their step does
        groups.setdefault(multistep.variant((r.schedule.tables, r.index)), []).append(i)
    if len(groups) == 1:
        out = _group(rows, output, latents)
    else:  # each group's rows together, put back in place (a row's values are those its
        # kind left, in a dtype that holds every kind's exactly)
        dtype = torch.promote_types(latents.dtype, output.dtype)
        out = torch.empty_like(latents, dtype=dtype)
        for picked in groups.values():
            index = to_device(torch.tensor(picked), latents.device)
            part = _group([rows[i] for i in picked], output[index], latents[index])
            out[index] = part.to(dtype)
    for r in rows:
        r.index += 1
    return out


def _group(rows: Sequence[Row], output: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
    kind = rows[0].schedule.kind
    if kind == "multistep":
        positions = [(r.schedule.tables, r.index) for r in rows]
        histories, generators = [r.history for r in rows], [r.generator for r in rows]
        return multistep.step(positions, histories, output, latents, generators)
    c = Cols([r.schedule.tables.scalars[r.index] for r in rows], latents)
    return _STEPS[kind](c, rows, output, latents)


def _ddim(c: Cols, rows: Sequence[Row], eps: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """DDIMScheduler.step with eta 0, epsilon prediction, no clipping."""
    x0 = div(sample - mul(c["beta_sqrt"], eps), c["alpha_sqrt"])
    direction = mul(c["direction"], eps)
    return mul(c["alpha_prev_sqrt"], x0) + direction


def _euler(c: Cols, rows: Sequence[Row], eps: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
    """EulerDiscreteScheduler.step without churn, epsilon prediction (in float32)."""
    x = sample.to(torch.float32)
    x0 = x - mul(c["sigma"], eps)
    derivative = div(x - x0, c["sigma"])
    return (x + mul(c["dt"], derivative)).to(eps.dtype)


def _euler_ancestral(
    c: Cols, rows: Sequence[Row], eps: torch.Tensor, sample: torch.Tensor
) -> torch.Tensor:
    """EulerAncestralDiscreteScheduler.step, epsilon prediction (in float32): each row's noise
    from its own generator, as a pipeline's list of generators draws it."""
    from diffusers.utils.torch_utils import randn_tensor

    x = sample.to(torch.float32)
    x0 = x - mul(c["sigma"], eps)
    derivative = div(x - x0, c["sigma"])
    out = x + mul(c["dt"], derivative)
    row = (1, *eps.shape[1:])  # (a pipeline's list of generators: one draw of a row's shape each)
    noise = torch.cat(
        [randn_tensor(row, generator=r.generator, device=eps.device, dtype=eps.dtype) for r in rows]
    )
    return (out + mul(c["up"], noise)).to(eps.dtype)


def _flow_euler(
    c: Cols, rows: Sequence[Row], v: torch.Tensor, sample: torch.Tensor
) -> torch.Tensor:
    """FlowMatchEulerDiscreteScheduler.step (in float32)."""
    return (sample.to(torch.float32) + mul(c["dt"], v)).to(v.dtype)


_STEPS = {"ddim": _ddim, "euler": _euler, "euler-a": _euler_ancestral, "flow-euler": _flow_euler}
