"""Multistep schedulers (DPM-Solver++, UniPC, PNDM) stepped per row, for a whole batch.

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

Supported: DPM-Solver++ (orders 1 to 3, midpoint; its SDE `sde-dpmsolver++`, whose noise each
row draws from its own generator at each step, as diffusers draws it for a row alone: `Past`),
UniPC (predicting x0, bh1 or bh2, orders 1 to 3, with its corrector; the weighted sum of its
past differences as diffusers' `einsum`, each row's weights its own), PNDM (models/pndm.py: its
PLMS steps, and its Runge-Kutta warm-up where `skip_prk_steps` is false); for epsilon, v or
flow predictions where diffusers has them. `unsupported` (models/schedulers.py) names the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni_like.models import pndm
from vllm_omni_like.models.columns import Cols, to_device
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
    build = {"dpm": _dpm_tables, "unipc": _unipc_tables, "pndm": pndm.tables}[kind]
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
    sde = conf.algorithm_type == "sde-dpmsolver++"
    variants, scalars = [], []
    for i in range(start, n):
        lower_nums = min(i - start, conf.solver_order)
        final = i == n - 1 and (
            conf.euler_at_final
            or (conf.lower_order_final and n < 15)
            or conf.final_sigmas_type == "zero"
        )
        second = i == n - 2 and conf.lower_order_final and n < 15
        order = 3
        if conf.solver_order == 1 or lower_nums < 1 or final:
            order = 1
        elif conf.solver_order == 2 or lower_nums < 2 or second:
            order = 2
        row = {**_convert_scalars(s, i), **_dpm_update(s, i, order, sde)}
        # (order 3 keeps two past outputs: the second from the row's second step on)
        variants.append((conf.prediction_type, order, sde, conf.solver_order == 3 and i > start))
        scalars.append(row)
    return variants, scalars


def _dpm_update(s: Any, i: int, order: int, sde: bool) -> dict[str, float]:
    """The scalars of the update of `order` at step i, as its `*_order_update` computes them."""
    alpha_t, sigma_t, lambda_t = _lam(s, i + 1)
    _, sigma_s0, lambda_s0 = _lam(s, i)
    h = lambda_t - lambda_s0
    if sde:  # (its noise's weight, and the sample's decayed by exp(-h))
        cx, noise = (
            sigma_t / sigma_s0 * torch.exp(-h),
            sigma_t * torch.sqrt(1.0 - torch.exp(-2 * h)),
        )
        c0 = alpha_t * (1 - torch.exp(-2.0 * h))
        out = {"cx": cx, "c0": c0, "noise": noise}
    else:
        c0 = alpha_t * (torch.exp(-h) - 1.0)
        out = {"cx": sigma_t / sigma_s0, "c0": c0}
    if order > 1:
        _, _, lambda_s1 = _lam(s, i - 1)
        h_0 = lambda_s0 - lambda_s1
        r0 = h_0 / h
        out.update(inv_r0=1.0 / r0, c1=0.5 * c0)
    if order == 3:
        _, _, lambda_s2 = _lam(s, i - 2)
        r1 = (lambda_s1 - lambda_s2) / h
        out.update(inv_r1=1.0 / r1, k1=r0 / (r0 + r1), k2=1.0 / (r0 + r1))
        if sde:
            out["c1"] = alpha_t * ((1.0 - torch.exp(-2.0 * h)) / (-2.0 * h) + 1.0)
            out["c2"] = alpha_t * ((1.0 - torch.exp(-2.0 * h) - 2.0 * h) / (2.0 * h) ** 2 - 0.5)
        else:
            out["c1"] = alpha_t * ((torch.exp(-h) - 1.0) / h + 1.0)
            out["c2"] = alpha_t * ((torch.exp(-h) - 1.0 + h) / h**2 - 0.5)
    return {key: _f(value) for key, value in out.items()}


def _unipc_update(s: Any, t: int, s0: int, order: int, prefix: str) -> dict[str, float]:
    """multistep_uni_{p,c}_bh_update's scalars from sigma index `t` to `s0` (and the `order - 1`
    before s0): `rk1`.. (each past output's difference divided by one) and the weights of those
    differences (`rho1`..: the predictor's 0.5 at order 2, else a solve, as diffusers does)."""
    alpha_t, sigma_t, lambda_t = _lam(s, t)
    _, sigma_s0, lambda_s0 = _lam(s, s0)
    h = lambda_t - lambda_s0
    hh = -h  # (predicting x0)
    h_phi_1 = torch.expm1(hh)
    b_h = hh if s.config.solver_type == "bh1" else torch.expm1(hh)
    out = {"cx": sigma_t / sigma_s0, "c0": alpha_t * h_phi_1, "cb": alpha_t * b_h}
    rks = [(_lam(s, s0 - k)[2] - lambda_s0) / h for k in range(1, order)]
    out.update({f"rk{k + 1}": rk for k, rk in enumerate(rks)})
    rks_t = torch.stack([*rks, torch.ones(())])
    h_phi_k = h_phi_1 / hh - 1
    factorial, big_r, b = 1, [], []
    for k in range(1, order + 1):
        big_r.append(torch.pow(rks_t, k - 1))
        b.append(h_phi_k * factorial / b_h)
        factorial *= k + 1
        h_phi_k = h_phi_k / hh - 1 / factorial
    if prefix == "p" and order == 2:
        out["rho1"] = torch.tensor(0.5)
    elif prefix == "p" and order > 2:
        rhos = torch.linalg.solve(torch.stack(big_r)[:-1, :-1], torch.stack(b)[:-1])
        out.update({f"rho{k + 1}": rho for k, rho in enumerate(rhos)})
    elif prefix == "c":  # (the corrector's: 0.5 at order 1, else a solve; its last for now's)
        rhos = torch.linalg.solve(torch.stack(big_r), torch.stack(b)) if order > 1 else None
        rhos = torch.tensor([0.5]) if rhos is None else rhos
        out.update({f"rho{k + 1}": rho for k, rho in enumerate(rhos[:-1])})
        out["rho_last"] = rhos[-1]
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
        # (the past outputs a row holds: as many as its solver's order, once it has them)
        held = min(i - start, conf.solver_order)
        variants.append((conf.prediction_type, corrector, order, held, conf.solver_order))
        scalars.append(row)
        previous = order
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


class Past:
    """The rows' histories, read by name as one batch tensor, and (a stochastic solver) each
    row's noise for this step from its own generator."""

    def __init__(self, histories: list[dict[str, torch.Tensor]], generators: list[Any]) -> None:
        self.histories, self.generators = histories, generators

    def __call__(self, name: str) -> torch.Tensor:
        return torch.cat([h[name] for h in self.histories])

    def noise(self, like: torch.Tensor) -> torch.Tensor:
        """float32 noise of `like`'s shape, a draw of a row's shape from each row's generator
        (as a pipeline running the row alone draws it in its scheduler's step)."""
        from diffusers.utils.torch_utils import randn_tensor

        row = (1, *like.shape[1:])
        draws = [
            randn_tensor(row, generator=g, device=like.device, dtype=torch.float32)
            for g in self.generators
        ]
        return torch.cat(draws)


def step(
    positions: list[tuple[Tables, int]],
    histories: list[dict[str, torch.Tensor]],
    eps: torch.Tensor,
    x: torch.Tensor,
    generators: list[Any] | None = None,
) -> torch.Tensor:
    """One step of rows that share a variant, each at its own position (its schedule's tables,
    its index); each row's history (one tensor of a row's shape per name) is replaced by the
    new one. `generators`: each row's, for a stochastic solver's noise."""
    kind, *what = variant(positions[0])
    c = Cols([tabs.scalars[i] for tabs, i in positions], x)
    past = Past(histories, generators or [None] * len(histories))
    out, keep = {"dpm": _dpm, "unipc": _unipc, "pndm": pndm.step}[kind](
        c, tuple(what), eps, x, past
    )
    for b, history in enumerate(histories):
        for name, value in keep.items():
            if value is None:
                history.pop(name, None)
            else:
                history[name] = value[b : b + 1]
    return out


def _dpm(
    c: Cols, variant: tuple[Any, ...], eps: torch.Tensor, x: torch.Tensor, past: Any
) -> tuple[torch.Tensor, Keep]:
    _, order, sde, keep_two = variant
    m0 = _convert(c, variant, eps, x)
    sample = x.to(torch.float32)
    noise = past.noise(m0) if sde else None  # (drawn before the update, as diffusers does)
    x_t = _mul(c["cx"], sample)
    if order == 1:
        d = [m0]
    elif order == 2:
        d = [m0, _mul(c["inv_r0"], m0 - past("m1"))]
    else:
        m1 = past("m1")
        d1_0, d1_1 = _mul(c["inv_r0"], m0 - m1), _mul(c["inv_r1"], m1 - past("m2"))
        d = [m0, d1_0 + _mul(c["k1"], d1_0 - d1_1), _mul(c["k2"], d1_0 - d1_1)]
    # DPM-Solver++: x - c0 D0 - c1 D1 (order 3: + c1 D1 - c2 D2); its SDE: every term added
    signs = (1, 1, 1) if sde else (-1, -1, -1) if order < 3 else (-1, 1, -1)
    for sign, name, term in zip(signs, ("c0", "c1", "c2"), d, strict=False):
        x_t = x_t + _mul(c[name], term) if sign > 0 else x_t - _mul(c[name], term)
    if noise is not None:
        x_t = x_t + _mul(c["noise"], noise)
    keep: Keep = {"m1": m0}
    if keep_two:
        keep["m2"] = past("m1")
    return x_t.to(m0.dtype), keep


def _uni(
    c: Cols, p: str, order: int, x: torch.Tensor, m0: torch.Tensor, past: list[torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A bh update's first part from `x` with m0, and its differences to the past outputs
    (newest first), each divided by its rk."""
    x_t_ = _mul(c[f"{p}_cx"], x) - _mul(c[f"{p}_c0"], m0)
    return x_t_, [_div(m - m0, c[f"{p}_rk{k + 1}"]) for k, m in enumerate(past[: order - 1])]


def _weighted(c: Cols, names: list[str], d: list[torch.Tensor]) -> torch.Tensor:
    """diffusers' `einsum("k,bkc...->bc...", rhos, D1s)` with each row's rhos (in the
    differences' dtype, as it casts them); one difference: a product, as einsum's."""
    rhos = [c[name].to(d[0].dtype) for name in names]
    if len(d) == 1:
        return _mul(rhos[0], d[0])
    stacked, device = torch.stack(d, dim=1), d[0].device
    if all(r.dim() == 0 for r in rhos):
        return torch.einsum("k,bkc...->bc...", to_device(torch.stack(rhos), device), stacked)
    rows = [(r if r.dim() else to_device(r, device)).reshape(-1) for r in rhos]  # (a column's
    rows = [r.expand(stacked.shape[0]) for r in rows]  # on the device already)
    return torch.einsum("bk,bkc...->bc...", torch.stack(rows, dim=1), stacked)


def _unipc(
    c: Cols, variant: tuple[Any, ...], eps: torch.Tensor, x: torch.Tensor, past: Any
) -> tuple[torch.Tensor, Keep]:
    _, corrector, order, held, solver_order = variant
    model_t = _convert(c, variant, eps, x)
    ms = [past(f"m{k}") for k in range(1, held + 1)]  # the past outputs, newest first
    if corrector:
        last = past("last")
        x_t_, d = _uni(c, "c", corrector, last, ms[0], ms[1:])
        corr = _weighted(c, [f"c_rho{k + 1}" for k in range(len(d))], d) if d else 0
        term = corr + _mul(c["c_rho_last"].to(last.dtype), model_t - ms[0])
        x = (x_t_ - _mul(c["c_cb"], term)).to(last.dtype)
    x_t_, d = _uni(c, "p", order, x, model_t, ms)
    if d:
        x_t_ = x_t_ - _mul(c["p_cb"], _weighted(c, [f"p_rho{k + 1}" for k in range(len(d))], d))
    keep: Keep = {"last": x, "m1": model_t}
    keep.update({f"m{k + 2}": m for k, m in enumerate(ms[: solver_order - 1])})
    return x_t_.to(x.dtype), keep
