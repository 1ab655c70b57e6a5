"""Per-row scheduler steps for a whole batch (models/row_schedulers.py): each row's result is
what the diffusers scheduler's own `step` gives that row alone - rows at other step counts,
positions, generators and schedulers beside it change nothing."""

from __future__ import annotations

import diffusers
import pytest
import torch

from vllm_omni_like.models import row_schedulers as rs
from vllm_omni_like.models.tiny import SD_SCHEDULER

SD = diffusers.DDIMScheduler(**SD_SCHEDULER).config
KINDS = {
    "ddim": (diffusers.DDIMScheduler, SD),
    "euler": (diffusers.EulerDiscreteScheduler, SD),
    "euler-a": (diffusers.EulerAncestralDiscreteScheduler, SD),
    "flow-euler": (diffusers.FlowMatchEulerDiscreteScheduler, {"shift": 3.0}),
}
# (steps, index): first and last steps, several step counts side by side
ROWS = [(20, 0), (20, 7), (30, 28), (4, 3), (50, 10)]


def _alone(kind: str, steps: int, index: int, eps, sample, seed: int) -> torch.Tensor:
    cls, config = KINDS[kind]
    scheduler = cls.from_config(config)
    scheduler.set_timesteps(steps, device="cpu")
    scheduler._step_index = index  # where a pipeline's loop would be
    extra = {"generator": torch.Generator().manual_seed(seed)} if kind == "euler-a" else {}
    t = scheduler.timesteps[index]
    return scheduler.step(eps, t, sample, return_dict=False, **extra)[0]


def _rows(kinds: list[str]) -> list[rs.Row]:
    rows = []
    for b, (kind, (steps, index)) in enumerate(zip(kinds, ROWS, strict=True)):
        cls, config = KINDS[kind]
        schedule = rs.schedule_for(cls.from_config(config), steps)
        rows.append(rs.Row(schedule, index, torch.Generator().manual_seed(10 + b)))
    return rows


@pytest.mark.parametrize("kinds", [*([k] * len(ROWS) for k in KINDS), [*KINDS, "ddim"]])
def test_each_row_steps_as_its_scheduler_steps_it_alone(kinds):
    torch.manual_seed(0)
    sample, eps = torch.randn(len(ROWS), 4, 8, 8), torch.randn(len(ROWS), 4, 8, 8)
    rows = _rows(kinds)
    got = rs.step(rows, eps, sample)
    for b, (kind, (steps, index)) in enumerate(zip(kinds, ROWS, strict=True)):
        want = _alone(kind, steps, index, eps[b : b + 1], sample[b : b + 1], 10 + b)
        assert (got[b : b + 1] - want).abs().max().item() <= 1e-6, (kind, steps, index)
        assert rows[b].index == index + 1  # each row moved one step on


def test_euler_scales_its_input_and_others_keep_theirs():
    sample = torch.randn(len(ROWS), 4, 8, 8)
    rows = _rows(["euler", "ddim", "euler-a", "flow-euler", "euler"])
    scaled = rs.scale_input(rows, sample)
    for b, row in enumerate(rows):
        cls, config = KINDS[["euler", "ddim", "euler-a", "flow-euler", "euler"][b]]
        scheduler = cls.from_config(config)
        scheduler.set_timesteps(row.schedule.steps, device="cpu")
        scheduler._step_index = row.index
        if hasattr(scheduler, "scale_model_input"):
            t = scheduler.timesteps[row.index]
            want = scheduler.scale_model_input(sample[b : b + 1], t)
        else:
            want = sample[b : b + 1]
        assert torch.allclose(scaled[b : b + 1], want, atol=1e-6)


def test_a_scheduler_without_batched_steps_is_refused():
    with pytest.raises(ValueError, match="no batched steps for LMSDiscreteScheduler"):
        rs.schedule_for(diffusers.LMSDiscreteScheduler.from_config(SD), 20)
    sde = diffusers.DPMSolverMultistepScheduler.from_config(
        SD, algorithm_type="sde-dpmsolver", final_sigmas_type="sigma_min"
    )
    with pytest.raises(ValueError, match=r"with sde-dpmsolver \(its SDE solver runs as sde-dpm"):
        rs.schedule_for(sde, 20)
    fourth = diffusers.UniPCMultistepScheduler.from_config(SD, solver_order=4)
    with pytest.raises(ValueError, match=r"of order 4 \(orders 1 to 3 run here\)"):
        rs.schedule_for(fourth, 20)


FLOW = {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0}
MULTISTEP = [  # (name, base config, steps): each row its own scheduler and step count
    ("dpm++2m", SD, 20),
    ("dpm++2m-karras", SD, 9),
    ("pndm", SD, 12),
    ("unipc", SD, 7),
    ("unipc", diffusers.UniPCMultistepScheduler(**FLOW).config, 10),
    ("dpm++2m", SD, 4),
    ("dpm++2m-sde", SD, 8),  # (noise from each row's generator at each step)
    ("dpm++3m", SD, 9),
    ("dpm++3m", SD, 20),  # (no lower order before the last step: 15 steps or more)
    ("pndm-prk", SD, 6),  # (12 Runge-Kutta calls, then PLMS from their outputs)
    ("unipc-3", SD, 7),
    ("unipc-3", diffusers.UniPCMultistepScheduler(**FLOW).config, 4),
]


def _denoiser(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """A smooth stand-in for a model, each row on its own input."""
    return torch.tanh(0.3 * x + 0.001 * t.view(-1, 1, 1, 1)) + 0.1 * x


def test_multistep_rows_follow_their_own_trajectories_as_their_schedulers_alone_do():
    torch.manual_seed(0)
    start = torch.randn(len(MULTISTEP), 4, 8, 8)
    rows = [
        rs.Row(rs.schedule_for(rs.make_scheduler(name, config), steps), generator=_gen(b))
        for b, (name, config, steps) in enumerate(MULTISTEP)
    ]
    x = start.clone()
    while not all(r.done for r in rows):  # the batch: rows that ended drop out
        live = [b for b, r in enumerate(rows) if not r.done]
        states = [rows[b] for b in live]
        t = torch.stack([r.timestep for r in states])
        x[live] = rs.step(states, _denoiser(x[live], t), x[live])
    for b, (name, config, steps) in enumerate(MULTISTEP):
        alone, calls = _alone_trajectory(name, config, steps, start[b : b + 1], _gen(b))
        assert torch.equal(x[b : b + 1], alone), (name, steps)  # bit for bit
        assert rows[b].index == calls


def _gen(b: int) -> torch.Generator:
    return torch.Generator().manual_seed(100 + b)


def _alone_trajectory(name, config, steps, x, generator, start=0) -> tuple[torch.Tensor, int]:
    """The row alone through the diffusers scheduler, as a pipeline steps it (an image-to-image
    pipeline from its begin index `start`; a stochastic solver given the row's generator)."""
    scheduler = rs.make_scheduler(name, config)
    scheduler.set_timesteps(steps, device="cpu")
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(start)
    extra = {"generator": generator} if "sde" in name else {}
    for t in scheduler.timesteps[start:]:
        out = _denoiser(x, t.float().reshape(1))
        x = scheduler.step(out, t, x, return_dict=False, **extra)[0]
    return x, len(scheduler.timesteps) - start


# (name, steps, the batch step it joins at, the step of its schedule it starts from)
JOINS = [
    ("dpm++3m", 20, 0, 0),
    ("dpm++2m-sde", 9, 2, 0),
    ("pndm-prk", 6, 5, 0),  # (joins while the others are in their warm-up or past it)
    ("unipc-3", 8, 3, 0),
    ("dpm++3m", 10, 4, 3),  # (an image-to-image row: its solver restarts at first order)
    ("pndm-prk", 7, 1, 2),  # (its counter starts again at the row's first call)
    ("unipc-3", 9, 6, 4),
    ("dpm++2m-sde", 12, 7, 5),
]


def test_rows_joining_a_busy_batch_at_later_steps_follow_their_own_trajectories():
    """The solvers whose steps draw noise, keep three outputs or warm up by Runge-Kutta: a row
    that joins rows already under way, at a later step of its own schedule or not, ends where
    its scheduler alone takes it, bit for bit."""
    torch.manual_seed(1)
    start = torch.randn(len(JOINS), 4, 8, 8)
    rows = [
        rs.Row(rs.schedule_for(rs.make_scheduler(n, SD), steps, start=s), generator=_gen(b))
        for b, (n, steps, _, s) in enumerate(JOINS)
    ]
    x, step = start.clone(), 0
    while not all(r.done for r in rows) and step < 100:
        live = [b for b, r in enumerate(rows) if JOINS[b][2] <= step and not r.done]
        states = [rows[b] for b in live]
        t = torch.stack([r.timestep for r in states])
        x[live] = rs.step(states, _denoiser(x[live], t), x[live])
        step += 1
    for b, (name, steps, _, s) in enumerate(JOINS):
        alone, calls = _alone_trajectory(name, SD, steps, start[b : b + 1], _gen(b), s)
        assert torch.equal(x[b : b + 1], alone), (name, steps, s)
        assert rows[b].index == calls
