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
    with pytest.raises(ValueError, match="no batched steps for PNDMScheduler"):
        rs.schedule_for(diffusers.PNDMScheduler.from_config(SD), 20)
