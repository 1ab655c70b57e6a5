"""Per-request generation parameters (no logic beyond the batching key)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_STRENGTH = 0.8  # an image-to-image edit's when it gives none (diffusers' default)


@dataclass(frozen=True)
class GuideSpec:
    """A constraint on an LLM row's output (stages/llm/guided.py compiles it): `value` is a JSON
    schema (as JSON text), a regex, a JSON list of choices, or a Lark grammar."""

    kind: str
    value: str


@dataclass(frozen=True)
class LoraRef:
    """A LoRA adapter a request asks for, by name (vllm_omni_like/loras.py), at its scale."""

    name: str
    scale: float = 1.0


@dataclass(frozen=True)
class GenerationParams:
    """What a request asks of every stage; each stage reads the fields it understands."""

    width: int | None = None
    height: int | None = None
    n: int = 1
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    # two experts (Wan2.2-A14B): the low-noise expert's scale (None: guidance_scale)
    guidance_scale_2: float | None = None
    negative_prompt: str | None = None
    seed: int | None = None
    strength: float | None = None
    num_frames: int | None = None
    fps: int | None = None
    partial_images: int = 0
    scheduler: str | None = None  # models/schedulers.py's names; None: the model's own
    # step cache (a stage with --cache): this request's threshold (None: the stage's; 0: off)
    cache_threshold: float | None = None
    # LoRA adapters of the diffusion stage, each at its scale (one batch mixes any of them)
    loras: tuple[LoraRef, ...] = ()
    # LLM stage (each row of a batch its own: stages/llm/token_rules.py)
    max_new_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False  # each output token's log-probability (the model's, raw)
    top_logprobs: int = 0  # and this many of the most likely tokens at each position
    stream_text: bool = False  # each step's new text goes out as it is made
    guide: GuideSpec | None = None
    # a chat (role, content) turns, rendered with the model's chat template (else the stage's
    # prompt template over the user turns); None: `prompt` as it is
    messages: tuple[tuple[str, str], ...] | None = None
    # null stage: per-step delay in seconds
    step_delay: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def shape_key(self, mode: str) -> tuple[Any, ...]:
        """Everything that decides tensor shapes or the step loop: equal keys batch together."""
        return (
            mode,
            self.width,
            self.height,
            self.num_frames,
            self.num_inference_steps,
            self.guidance_scale,
            self.guidance_scale_2,
            self.strength,
            self.negative_prompt is None,
            self.scheduler,
            self.step_delay,
        )
