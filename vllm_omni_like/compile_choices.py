"""What a stage's compile may be asked for: torch.compile's modes, regional compilation, CUDA
graphs of the denoiser's forward, and the checks of a stage's choices (torch-free: the API
process reads them)."""

from __future__ import annotations

from typing import Any

from vllm_omni_like.errors import ConfigError

COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
REGIONAL_COMPILE_MODES = ("auto", "on", "off")  # auto: on with --quantization fp8
# torch.compile's modes that capture CUDA graphs of their own: refused at start-up (measured on an
# H100 with reduce-overhead: the stage warmed up, then every request crashed its worker with
# "operation failed due to a previous error during capture"; max-autotune captures them too).
# The stage's own graphs (`cuda_graphs`) capture each bucket's forward once its warm-up is done.
CUDA_GRAPH_COMPILE_MODES = ("reduce-overhead", "max-autotune")
# auto: on for a compiled stage on CUDA that no other rank serves; on: asked for; off: never
CUDA_GRAPHS_MODES = ("auto", "on", "off")
# the text encoders compiled too (one graph an encoder: texts encoded one a call, at the
# family's fixed token length); auto: on with --compile on CUDA, where eager encoders are
# launch-bound (a join's host time); off: eager encoders (no start-time cost)
TEXT_ENCODER_COMPILE_MODES = ("auto", "on", "off")


def check_compile(config: Any) -> None:
    """A StageConfig's compile choices, refused at start-up (`ConfigError`) when they cannot
    run: a mode whose own graphs crash the worker, CUDA graphs asked for without --compile or
    on a replica of several ranks (rank 0 hands each forward to the others: nothing to capture
    on one device)."""
    where = f"stage {config.name!r}"
    check_text_encoders(config, where)
    if config.compile_mode in CUDA_GRAPH_COMPILE_MODES:
        raise ConfigError(
            f"{where}: --compile-mode {config.compile_mode} is refused: torch.compile's own CUDA "
            "graphs crash the worker at its first request after the warm-up; use default or "
            "max-autotune-no-cudagraphs (with --cuda-graphs for the stage's own graphs)"
        )
    if config.cuda_graphs != "on":
        return
    if not config.compile:
        raise ConfigError(
            f"{where}: --cuda-graphs on captures the compiled buckets' forwards: it needs --compile"
        )
    if config.leads:
        raise ConfigError(
            f"{where}: --cuda-graphs on is not built for a replica of several ranks "
            "(--cfg-parallel, --sequence-parallel): leave it auto or off"
        )


def check_text_encoders(config: Any, where: str) -> None:
    """`--compile-text-encoders`: one of its choices; `on` needs --compile (it compiles with
    the stage's backend and is warmed up by the stage's warm-up)."""
    mode = config.compile_text_encoders
    if mode not in TEXT_ENCODER_COMPILE_MODES:
        raise ConfigError(
            f"{where}: compile_text_encoders must be one of "
            f"{', '.join(TEXT_ENCODER_COMPILE_MODES)}, not {mode!r}"
        )
    if mode == "on" and not config.compile:
        raise ConfigError(
            f"{where}: --compile-text-encoders on compiles the text encoders beside the "
            "denoiser, warmed up by its warm-up: it needs --compile"
        )


def text_encoders_compiled(config: Any, device_type: str) -> bool:
    """Whether a stage compiles its text encoders: `on`, or `auto` with --compile on CUDA."""
    mode = config.compile_text_encoders
    return config.compile and (mode == "on" or (mode == "auto" and device_type == "cuda"))
