"""Multistep schedulers (DPM-Solver++ 2M, UniPC, PNDM) stepped per row, for a whole batch.

Each keeps a history per row (its last converted outputs, UniPC's last sample, PNDM's last
outputs and saved sample: `Row.history`). A step's scalars (sigmas, alphas, their logs, the
solver's weights) depend only on the schedule and the position in it, so they are computed once
per (scheduler, steps) on the host, each as diffusers computes it (its own functions on float32
0-dim tensors), and kept per step (`Tables`). A batch's step gathers each row's scalars into
float32 columns and applies them to the batch's tensors in the order of operations of the
diffusers scheduler's `step`, each product rounded to the dtype a 0-dim scalar leaves it in
(`_mul`): on the CPU each row's result is bit for bit the one diffusers gives that row alone.
Rows at different stages of their solver (a first-order step beside a second-order one) form
groups by `variant`, each group one vectorised update. Never one `step()` call per row.

Supported: DPM-Solver++ (orders 1 and 2, midpoint), UniPC (predicting x0, bh1 or bh2, orders
1 and 2, with its corrector), PNDM's PLMS steps (`skip_prk_steps`); for epsilon, v or flow
predictions where diffusers has them. `unsupported` (models/schedulers.py) names the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni_like.models.columns import Cols
from vllm_omni_like.models.columns import div as _div
from vllm_omni_like.models.columns import mul as _mul

# what a solver keeps of a step for the next ones (None: forget it)
Keep = dict[str, torch.Tensor | None]


@dataclass(frozen=True)
class Tables:
    """Per step of a schedule: its variant (what the step does) and its scalars."""

    kind: str  # "dpm" | "unipc" | "pndm"
    variants: tuple[tuple[Any, ...], ...]
    scalars: tuple[dict[str, float], ...]


KIND = {
    "DPMSolverMultistepScheduler": "dpm",
    "UniPCMultistepScheduler": "unipc",
    "PNDMScheduler": "pndm",
}


def tables(scheduler: Any, start: int = 0) -> Tables:
    """The per-step tables of `scheduler` (its timesteps set, on the CPU) from its step
    `start` on (an image-to-image row's first: its solver begins there with no history, as
    the pipeline's scheduler does from its begin index)."""
    kind = KIND[type(scheduler).__name__]
    build = {"dpm": _dpm_tables, "unipc": _unipc_tables, "pndm": _pndm_tables}[kind]
    variants, scalars = build(scheduler, start)
    return Tables(kind, tuple(variants), tuple(scalars))


# ---- the scalars, as diffusers computes them ------------------------------------------------
def _f(value: Any) -> float:
    return float(value)  # a float32 0-dim tensor's value, exactly


def _convert_scalars(s: Any, i: int) -> dict[str, float]:
    """convert_model_output's scalars at step i (both schedulers share the formulas)."""
    sigma = s.sigmas[i]
    alpha_t, sigma_t = s._sigma_to_alpha_sigma_t(sigma)
    if s.config.prediction_type == "flow_prediction":
        return {"conv_sigma": _f(sigma), "conv_alpha": 1.0}
    return {"conv_sigma": _f(sigma_t), "conv_alpha": _f(alpha_t)}


def _lam(s: Any, k: int) -> tuple[Any, Any, Any]:
    alpha, sigma = s._sigma_to_alpha_sigma_t(s.sigmas[k])
    return alpha, sigma, torch.log(alpha) - torch.log(sigma)


def _dpm_tables(s: Any, start: int) -> tuple[list[Any], list[Any]]:
    conf, n = s.config, len(s.timesteps)
    variants, scalars = [], []
    for i in range(start, n):
        lower_nums = min(i - start, conf.solver_order)
        final = i == n - 1 and (
            conf.euler_at_final
            or (conf.lower_order_final and n < 15)
            or conf.final_sigmas_type == "zero"
        )
        order = 1 if conf.solver_order == 1 or lower_nums < 1 or final else 2
        alpha_t, sigma_t, lambda_t = _lam(s, i + 1)
        _, sigma_s0, lambda_s0 = _lam(s, i)
        h = lambda_t - lambda_s0
        c0 = alpha_t * (torch.exp(-h) - 1.0)
        row = {**_convert_scalars(s, i), "cx": _f(sigma_t / sigma_s0), "c0": _f(c0)}
        if order == 2:
            _, _, lambda_s1 = _lam(s, i - 1)
            r0 = (lambda_s0 - lambda_s1) / h
            row.update(inv_r0=_f(1.0 / r0), c1=_f(0.5 * c0))
        variants.append((conf.prediction_type, order))
        scalars.append(row)
    return variants, scalars


def _unipc_update(s: Any, t: int, s0: int, order: int, prefix: str) -> dict[str, float]:
    """multistep_uni_{p,c}_bh_update's scalars from sigma index `t` to `s0` (and s0 - 1)."""
    alpha_t, sigma_t, lambda_t = _lam(s, t)
    _, sigma_s0, lambda_s0 = _lam(s, s0)
    h = lambda_t - lambda_s0
    hh = -h  # (predicting x0)
    h_phi_1 = torch.expm1(hh)
    b_h = hh if s.config.solver_type == "bh1" else torch.expm1(hh)
    out = {"cx": sigma_t / sigma_s0, "c0": alpha_t * h_phi_1, "cb": alpha_t * b_h}
    if prefix == "c" and order == 1:
        out["rho_last"] = torch.tensor(0.5)  # (the first-order corrector's weight)
    if order == 2:
        _, _, lambda_s1 = _lam(s, s0 - 1)
        rk = (lambda_s1 - lambda_s0) / h
        out["rk"] = rk
        if prefix == "c":  # the corrector's weights: a 2x2 solve (the predictor's are 0.5)
            rks = torch.stack([rk, torch.ones(())])
            h_phi_k = h_phi_1 / hh - 1
            factorial, big_r, b = 1, [], []
            for k in range(1, order + 1):
                big_r.append(torch.pow(rks, k - 1))
                b.append(h_phi_k * factorial / b_h)
                factorial *= k + 1
                h_phi_k = h_phi_k / hh - 1 / factorial
            rhos = torch.linalg.solve(torch.stack(big_r), torch.stack(b))
            out["rho0"], out["rho_last"] = rhos[0], rhos[-1]
    return {f"{prefix}_{key}": _f(value) for key, value in out.items()}


def _unipc_tables(s: Any, start: int) -> tuple[list[Any], list[Any]]:
    conf, n = s.config, len(s.timesteps)
    variants, scalars = [], []
    previous: int | None = None  # the order of the last predictor: the corrector's now
    for i in range(start, n):
        this = min(conf.solver_order, n - i) if conf.lower_order_final else conf.solver_order
        order = min(this, min(i - start, conf.solver_order) + 1)
        row = {**_convert_scalars(s, i), **_unipc_update(s, i + 1, i, order, "p")}
        corrector = 0
        if i > start and (i - 1) not in conf.disable_corrector:
            corrector = previous or 0
            row.update(_unipc_update(s, i, i - 1, corrector, "c"))
        variants.append((conf.prediction_type, corrector, order, i > start))
        scalars.append(row)
        previous = order
    return variants, scalars


def _pndm_tables(s: Any, start: int) -> tuple[list[Any], list[Any]]:
    ratio = s.config.num_train_timesteps // s.num_inference_steps
    variants, scalars, held = [], [], 0
    for i, t in enumerate(s.timesteps[start:]):  # (its counter starts at the slice)
        t, prev = int(t), int(t) - ratio
        if i == 1:
            t, prev = t + ratio, t
        else:
            held = min(held, 3) + 1
        case = "first" if i == 0 else "second" if i == 1 else f"ets{held}"
        alpha_t = s.alphas_cumprod[t]
        alpha_prev = s.alphas_cumprod[prev] if prev >= 0 else s.final_alpha_cumprod
        beta_t, beta_prev = 1 - alpha_t, 1 - alpha_prev
        denom = alpha_t * beta_prev ** (0.5) + (alpha_t * beta_t * alpha_prev) ** (0.5)
        row = {
            "coeff": _f((alpha_prev / alpha_t) ** (0.5)),
            "num": _f(alpha_prev - alpha_t),
            "denom": _f(denom),
        }
        variants.append((case,))
        scalars.append(row)
    return variants, scalars


# ---- a batch's step ---------------------------------------------------------------------------
def _convert(c: Cols, variant: tuple[Any, ...], eps: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    prediction = variant[0]
    if prediction == "epsilon":
        return _div(x - _mul(c["conv_sigma"], eps), c["conv_alpha"])
    if prediction == "v_prediction":
        return _mul(c["conv_alpha"], x) - _mul(c["conv_sigma"], eps)
    if prediction == "flow_prediction":
        return x - _mul(c["conv_sigma"], eps)
    return eps  # "sample"


def variant(position: tuple[Tables, int]) -> tuple[Any, ...]:
    """What the step at `position` does: rows with equal variants step together."""
    tabs, i = position
    return (tabs.kind, *tabs.variants[i])


def step(
    positions: list[tuple[Tables, int]],
    histories: list[dict[str, torch.Tensor]],
    eps: torch.Tensor,
    x: torch.Tensor,
) -> torch.Tensor:
    """One step of rows that share a variant, each at its own position (its schedule's tables,
    its index); each row's history (one tensor of a row's shape per name) is replaced by the
    new one."""
    kind, *what = variant(positions[0])
    c = Cols([tabs.scalars[i] for tabs, i in positions], x)

    def past(name: str) -> torch.Tensor:
        return torch.cat([h[name] for h in histories])

    out, keep = {"dpm": _dpm, "unipc": _unipc, "pndm": _pndm}[kind](c, tuple(what), eps, x, past)
    for b, history in enumerate(histories):
        for name, value in keep.items():
            if value is None:
                history.pop(name, None)
            else:
                history[name] = value[b : b + 1] if isinstance(value, torch.Tensor) else value[b]
    return out


def _dpm(
    c: Cols, variant: tuple[Any, ...], eps: torch.Tensor, x: torch.Tensor, past: Any
) -> tuple[torch.Tensor, Keep]:
    m0 = _convert(c, variant, eps, x)
    sample = x.to(torch.float32)
    if variant[1] == 1:
        x_t = _mul(c["cx"], sample) - _mul(c["c0"], m0)
    else:
        d1 = _mul(c["inv_r0"], m0 - past("m1"))
        x_t = _mul(c["cx"], sample) - _mul(c["c0"], m0) - _mul(c["c1"], d1)
    return x_t.to(m0.dtype), {"m1": m0}


def _uni(c: Cols, p: str, order: int, x: torch.Tensor, m0: torch.Tensor, m1: Any) -> Any:
    """A bh update's first part from `x` with m0, and (order 2) its difference to m1."""
    x_t_ = _mul(c[f"{p}_cx"], x) - _mul(c[f"{p}_c0"], m0)
    if order == 2:
        d1 = _div(m1 - m0, c[f"{p}_rk"])
        return x_t_, d1
    return x_t_, None


def _unipc(
    c: Cols, variant: tuple[Any, ...], eps: torch.Tensor, x: torch.Tensor, past: Any
) -> tuple[torch.Tensor, Keep]:
    _, corrector, order, _ = variant
    model_t = _convert(c, variant, eps, x)
    if corrector:
        last, m0 = past("last"), past("m1")
        x_t_, d1 = _uni(c, "c", corrector, last, m0, past("m2") if corrector == 2 else None)
        corr = _mul(c["c_rho0"].to(last.dtype), d1) if d1 is not None else 0
        term = corr + _mul(c["c_rho_last"].to(last.dtype), model_t - m0)
        x = (x_t_ - _mul(c["c_cb"], term)).to(last.dtype)
    m1 = past("m1") if order == 2 else None
    x_t_, d1 = _uni(c, "p", order, x, model_t, m1)
    if d1 is not None:
        x_t_ = x_t_ - _mul(c["p_cb"], d1 * 0.5)  # (the predictor's weight: 0.5)
    keep = {"m1": model_t, "m2": past("m1") if variant[3] else None, "last": x}
    return x_t_.to(x.dtype), keep


def _pndm(
    c: Cols, variant: tuple[Any, ...], eps: torch.Tensor, x: torch.Tensor, past: Any
) -> tuple[torch.Tensor, Keep]:
    case = variant[0]
    sample, keep = x, Keep()
    if case == "first":
        output, keep = eps, {"e1": eps, "cur": x}
    elif case == "second":
        output, sample = (eps + past("e1")) / 2, past("cur")
        keep = {"cur": None}
    else:
        held = int(case[3:])
        e = [eps] + [past(f"e{k}") for k in range(1, held)]  # newest first
        if held == 2:
            output = (3 * e[0] - e[1]) / 2
        elif held == 3:
            output = (23 * e[0] - 16 * e[1] + 5 * e[2]) / 12
        else:
            output = (1 / 24) * (55 * e[0] - 59 * e[1] + 37 * e[2] - 9 * e[3])
        keep = {f"e{k + 1}": e[k] for k in range(min(held, 3))}
    prev = _mul(c["coeff"], sample) - _div(_mul(c["num"], output), c["denom"])
    return prev, keep
