"""The schedulers a request may name (its `scheduler` field), torch-free.

A name stands for a diffusers scheduler class and the settings it is built with from the
model's own scheduler config (`from_config(config, **overrides)`), as a diffusers user would
swap it in. Which names a model takes is its family's (`Family.schedulers`); the row-level
steps that run them are models/row_schedulers.py. The API process reads these to validate a
request and to tell whether a stage's batches run our own loop (models/registry.py `loop_for`).
"""

from __future__ import annotations

from typing import Any

# name -> (diffusers class, settings over the model's scheduler config)
SCHEDULERS: dict[str, tuple[str, dict[str, Any]]] = {
    "ddim": ("DDIMScheduler", {"clip_sample": False}),
    "pndm": ("PNDMScheduler", {"skip_prk_steps": True}),
    "euler": ("EulerDiscreteScheduler", {}),
    "euler-a": ("EulerAncestralDiscreteScheduler", {}),
    "dpm++2m": (
        "DPMSolverMultistepScheduler",
        {"algorithm_type": "dpmsolver++", "solver_order": 2, "use_karras_sigmas": False},
    ),
    "dpm++2m-karras": (
        "DPMSolverMultistepScheduler",
        {"algorithm_type": "dpmsolver++", "solver_order": 2, "use_karras_sigmas": True},
    ),
    "dpm++2m-sde": (
        "DPMSolverMultistepScheduler",
        {"algorithm_type": "sde-dpmsolver++", "solver_order": 2, "use_karras_sigmas": False},
    ),
    "dpm++3m": (
        "DPMSolverMultistepScheduler",
        {"algorithm_type": "dpmsolver++", "solver_order": 3, "use_karras_sigmas": False},
    ),
    "pndm-prk": ("PNDMScheduler", {"skip_prk_steps": False}),
    "unipc": ("UniPCMultistepScheduler", {}),
    "unipc-3": ("UniPCMultistepScheduler", {"solver_order": 3}),
    "flow-euler": ("FlowMatchEulerDiscreteScheduler", {}),
}

# classes whose step is linear in the sample, the model output, the scheduler's own history (and
# an SDE's noise) (models/multistep.py reads the coefficients off diffusers' step)
MULTISTEP = ("DPMSolverMultistepScheduler", "UniPCMultistepScheduler", "PNDMScheduler")
# classes stepped by their own vectorised code (models/row_schedulers.py)
EXPLICIT = (
    "DDIMScheduler",
    "EulerDiscreteScheduler",
    "EulerAncestralDiscreteScheduler",
    "FlowMatchEulerDiscreteScheduler",
)


def unsupported(class_name: str, config: dict[str, Any]) -> str | None:
    """Why rows cannot step with this scheduler class and config; None when they can."""
    if class_name not in MULTISTEP + EXPLICIT:
        return f"{class_name} has no row-level steps"
    if class_name in MULTISTEP:
        algorithm = str(config.get("algorithm_type", "dpmsolver++"))
        if "sde" in algorithm and algorithm != "sde-dpmsolver++":
            return f"{class_name} with {algorithm} (its SDE solver runs as sde-dpmsolver++)"
        if class_name == "PNDMScheduler":
            if config.get("prediction_type", "epsilon") != "epsilon":
                return f"PNDMScheduler predicting {config.get('prediction_type')}"
            return None
        if int(config.get("solver_order", 2)) > 3:
            return f"{class_name} of order {config['solver_order']} (orders 1 to 3 run here)"
        if config.get("thresholding", False):
            return f"{class_name} with thresholding"
        if class_name == "DPMSolverMultistepScheduler" and (
            algorithm not in ("dpmsolver++", "sde-dpmsolver++")
            or config.get("solver_type", "midpoint") != "midpoint"
            or config.get("variance_type") is not None
        ):
            return "DPMSolverMultistepScheduler other than DPM-Solver++ (or its SDE) midpoint"
        if class_name == "UniPCMultistepScheduler" and (
            not config.get("predict_x0", True) or config.get("solver_p") is not None
        ):
            return "UniPCMultistepScheduler without predict_x0 or with solver_p"
        return None
    if class_name == "DDIMScheduler" and (
        config.get("clip_sample", True) or config.get("thresholding", False)
    ):
        return "DDIMScheduler with clip_sample or thresholding"
    flow = class_name == "FlowMatchEulerDiscreteScheduler"
    if not flow and config.get("prediction_type", "epsilon") != "epsilon":
        return f"{class_name} predicting {config.get('prediction_type')}"
    if flow and config.get("stochastic_sampling"):  # (a shift by the image's length is the
        return "FlowMatchEulerDiscreteScheduler with stochastic sampling"  # family's `mu`)
    return None
