"""Which precision a diffusion stage's denoisers run, torch-free: the families whose linear
layers run FP8 matmuls (`Family.fp8`), the refusal of any other, and the layers a family keeps
in the weights' dtype unless its adapter says otherwise (`Adapter.high_precision_layers`).

Every rule is a tuple of `fnmatch` patterns over a denoiser's module names (`*` crosses dots);
a linear layer that matches one keeps the weights' dtype, every other one runs FP8
(stages/diffusion/fp8.py).
"""

from __future__ import annotations

from vllm_omni_like.errors import ConfigError
from vllm_omni_like.models.family import Family

# Kept by default, each for a reason that holds in every transformer family here:
# - the embedders (the latents' and the text's first projections, the timestep, guidance and
#   pooled-text MLPs): their inputs are raw (sinusoids, VAE latents, encoder states), the first
#   layers' error reaches every block, and they run once a step on few rows or few features;
# - the modulation (adaptive norms' shift, scale and gate from the timestep): one row a sample,
#   so FP8 gains no time, while its error scales every activation of its block;
# - the final norm's modulation and projection: their output is the prediction itself.
DEFAULT_HIGH_PRECISION: tuple[str, ...] = (
    "*embed*",
    "*norm*.linear",
    "*modulation*",
    "norm_out.*",
    "proj_out",
)


def fp8_families() -> tuple[str, ...]:
    """The families `--quantization fp8` runs, by name."""
    from vllm_omni_like.models.registry import FAMILIES

    return tuple(f.name for f in FAMILIES if f.fp8)


def check_quantization(stage: str, family: Family, quantization: str) -> None:
    """Refuse `--quantization fp8` for a family whose denoiser does not run it (the UNet
    families, a pipeline no family claims): a start-up error naming the flag."""
    if quantization == "fp8" and not family.fp8:
        raise ConfigError(
            f"stage {stage!r}: --quantization fp8 runs the transformer families "
            f"({', '.join(fp8_families())}), not {family.name}: serve it with "
            "--quantization none"
        )


def check_attention(stage: str, family: Family, attention: str) -> None:
    """Refuse `--attention fp8` for a family whose attention it does not run (`Family.
    fp8_attention`: SD3's processors of its own, the UNet families, a pipeline no family
    claims): a start-up error naming the flag."""
    if attention == "fp8" and not family.fp8_attention:
        from vllm_omni_like.models.registry import FAMILIES

        runs = ", ".join(f.name for f in FAMILIES if f.fp8_attention)
        raise ConfigError(
            f"stage {stage!r}: --attention fp8 runs the families whose attention diffusers "
            f"dispatches ({runs}), not {family.name}: serve it with --attention sdpa"
        )


# The linear layers a LoRA adapter may target (fnmatch over a denoiser's module names, the
# names diffusers gives them): attention's projections and the MLPs (feed-forward networks).
# Anything else an adapter names (a modulation, an embedding, a LoCon convolution) is refused
# by name when the adapter is read (stages/diffusion/lora_files.py).
LORA_LAYERS: tuple[str, ...] = (
    *("*.to_q", "*.to_k", "*.to_v", "*.to_out.0"),
    *("*.add_q_proj", "*.add_k_proj", "*.add_v_proj", "*.to_add_out"),
    *("*.ff.net.0.proj", "*.ff.net.2", "*.ff_context.net.0.proj", "*.ff_context.net.2"),
    *("*.ffn.net.0.proj", "*.ffn.net.2", "*_mlp.net.0.proj", "*_mlp.net.2"),
    *("*.proj_mlp", "single_transformer_blocks.*.proj_out", "*.feed_forward.w?"),
)
