"""PNDM stepped per row (models/multistep.py's third kind): its PLMS steps and, where the
scheduler keeps them (`skip_prk_steps` false), its Runge-Kutta warm-up.

PNDMScheduler decides what a call does from a counter (its calls so far) and the length of its
list of past outputs: with the warm-up, its first calls (12 for 4 or more steps) are pseudo
Runge-Kutta sub-steps, four a step - each from the sample its first sub-step saw, the fourth with
the outputs' weighted sum (1/6, 1/3, 1/3, 1/6) - whose first outputs open the PLMS history; without
it, PLMS starts at once (its first two calls a half step each). The counter and the history's
length depend only on the position, so the host replays them once per schedule (`tables`): each
call's case (the variant rows group by) and the scalars of `_get_prev_sample` at the timesteps it
uses. A batch's step then applies each case's formula to its rows at once, their history (the
last outputs newest first, the saved sample, the warm-up's running sum) row by row, in the
scheduler's order of operations: on the CPU each row's result is the scheduler's alone.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_omni_like.models.columns import Cols, div, mul


def tables(s: Any, start: int) -> tuple[list[Any], list[Any]]:
    """Each call's case and scalars from call `start` of `s`'s timesteps on (an image-to-image
    row's first: the pipeline's scheduler counts from 0 there, as here)."""
    ratio = s.config.num_train_timesteps // s.num_inference_steps
    warm_up = 0 if s.config.skip_prk_steps else len(s.prk_timesteps)
    variants, scalars, held = [], [], 0  # held: the length of the scheduler's `ets`
    for counter, passed in enumerate(s.timesteps[start:]):
        t = int(passed)
        if counter < warm_up:  # step_prk
            prev = t - (0 if counter % 2 else ratio // 2)
            t = int(s.prk_timesteps[counter // 4 * 4])
            held += 1 if counter % 4 == 0 else 0
            case = f"prk{counter % 4}"
        else:  # step_plms
            prev = t - ratio
            if counter != 1:
                held = min(held, 3) + 1
            else:
                t, prev = t + ratio, t
            case = "first" if counter == 0 else "second" if counter == 1 else f"ets{held}"
        variants.append((case, held))
        scalars.append(_prev_sample_scalars(s, t, prev))
    return variants, scalars


def _prev_sample_scalars(s: Any, t: int, prev: int) -> dict[str, float]:
    """_get_prev_sample's scalars from timestep `t` to `prev`, as it computes them."""
    alpha_t = s.alphas_cumprod[t]
    alpha_prev = s.alphas_cumprod[prev] if prev >= 0 else s.final_alpha_cumprod
    beta_t, beta_prev = 1 - alpha_t, 1 - alpha_prev
    denom = alpha_t * beta_prev ** (0.5) + (alpha_t * beta_t * alpha_prev) ** (0.5)
    return {
        "coeff": float((alpha_prev / alpha_t) ** (0.5)),
        "num": float(alpha_prev - alpha_t),
        "denom": float(denom),
    }


def step(
    c: Cols, variant: tuple[Any, ...], eps: torch.Tensor, x: torch.Tensor, past: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """One call of rows in one case: the new sample and what each row keeps (None: forget)."""
    case, held = variant
    sample = x
    keep: dict[str, torch.Tensor | None]
    if case.startswith("prk"):
        output, sample, keep = _warm_up(int(case[3:]), held, eps, x, past)
    elif case == "first":
        output, keep = eps, {"e1": eps, "cur": x}
    elif case == "second":
        output, sample = (eps + past("e1")) / 2, past("cur")
        keep = {"cur": None}
    else:
        e = [eps] + [past(f"e{k}") for k in range(1, held)]  # newest first
        if held == 2:
            output = (3 * e[0] - e[1]) / 2
        elif held == 3:
            output = (23 * e[0] - 16 * e[1] + 5 * e[2]) / 12
        else:
            output = (1 / 24) * (55 * e[0] - 59 * e[1] + 37 * e[2] - 9 * e[3])
        keep = {f"e{k + 1}": e[k] for k in range(min(held, 3))}
    prev = mul(c["coeff"], sample) - div(mul(c["num"], output), c["denom"])
    return prev, keep


def _warm_up(
    sub: int, held: int, eps: torch.Tensor, x: torch.Tensor, past: Any
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor | None]]:
    """step_prk's sub-step `sub` (0-3), `held` outputs kept after it: the output and sample it
    steps with, what it keeps."""
    if sub == 0:  # (its running sum starts from 0: `0 + t` is t)
        keep: dict[str, torch.Tensor | None] = {"acc": 1 / 6 * eps, "e1": eps, "cur": x}
        keep.update({f"e{k}": past(f"e{k - 1}") for k in range(2, min(held, 3) + 1)})
        return eps, x, keep
    if sub < 3:
        return eps, past("cur"), {"acc": past("acc") + 1 / 3 * eps}
    return past("acc") + 1 / 6 * eps, past("cur"), {"acc": None, "cur": None}
