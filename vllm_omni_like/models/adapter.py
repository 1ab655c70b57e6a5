"""What a worker does differently for each model family: the adapter interface.

A diffusion stage holds one adapter for its pipeline (`adapter_for`) and asks it everything that
differs between families (the stage names no model class): how its denoiser is called
(`predict`, `experts`, `expert_for`, `per_token_timesteps`, `image_conditions`), its guidance
(`guidance`, `guide`), schedulers, latents (`latent_shape`), decode (`decoder`, `preview`), video
hooks (`chunk_source`), the CFG and sequence-parallel splits, what to compile (text encoders:
text_encoders.py) or lay out for speed. Our own loop (stages/diffusion/step.py) steps with
`encode_text`, `noise`, `predict`, `guide` and `scheduler`; modes it does not run go through the
pipeline's `__call__`; rows from an image carry their own conditioning (models/row_conditions.py).
The contract tests (tests/models/) hold each family's answers equal to its pipeline's."""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vllm_omni_like.errors import ConfigError
from vllm_omni_like.models import image_latents
from vllm_omni_like.models.block_stack import StackedBlocks
from vllm_omni_like.models.family import Family
from vllm_omni_like.models.precision import DEFAULT_HIGH_PRECISION, LORA_LAYERS
from vllm_omni_like.models.row_conditions import RowConditions
from vllm_omni_like.models.text_encoders import TextEncoders
from vllm_omni_like.parallel.branches import BatchedCFG
from vllm_omni_like.parallel.cfg_parallel import Leader, PairCFG, SplitCFG
from vllm_omni_like.parallel.patch_decode import Bands
from vllm_omni_like.parallel.ulysses import SequenceShards
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.wire import Mode

logger = logging.getLogger(__name__)
Decoder = Callable[[torch.Tensor], torch.Tensor]  # latents -> pixels in [0, 1]


class Guidance(enum.Enum):
    """How a family applies classifier-free guidance."""

    BATCHED = "batched"  # both halves in one forward, by the pipeline itself (SD's UNet)
    TWO_CALLS = "two-calls"  # one call per branch, the same text length (Wan): batchable
    TRUE_CFG = "true-cfg"  # one call per branch, texts of different lengths (Qwen-Image)
    DISTILLED = "distilled"  # a guidance embedding, one branch (FLUX.1-dev)
    NONE = "none"


@dataclass(frozen=True)
class Expert:
    """One denoiser of a pipeline: the attribute it lives in, and the timestep from which down
    it runs (`boundary`; None: every step; a row's: `Adapter.expert_for`)."""

    name: str
    model: Any
    boundary: float | None = None


@dataclass(frozen=True)
class ChunkSource:
    """A module whose every call makes the next frames of a video
    (stages/diffusion/video_stream.py), and its output (B, C, t, H, W in model units) as uint8
    frames (B, t, H, W, 3) on the device."""

    module: torch.nn.Module
    to_pixels: Callable[[torch.Tensor], torch.Tensor]


class Adapter(RowConditions, StackedBlocks, TextEncoders):
    """The family-specific side of one pipeline (`pipe`). Subclasses: one per family."""

    family: Family  # (a class's, or the generic adapter's model's own)
    guidance: ClassVar[Guidance]
    image_conditions: ClassVar[tuple[str, ...]] = ()  # "edit", "inpaint", "image" (I2V)
    cfg_above: ClassVar[float] = 1.0  # a guidance scale above this runs the negative branch

    def __init__(self, pipe: Any, family: Family | None = None) -> None:
        self.pipe = pipe
        if family is not None:  # (the generic adapter's description is the model's own)
            self.family = family
        # the model's own scheduler, before a stage swaps it
        self.own_scheduler: Any = getattr(pipe, "scheduler", None)
        self._schedulers: dict[str, Any] = {}

    # ---- the denoiser and its conditioning -----------------------------------------------
    @property
    def denoiser_name(self) -> str:
        return "unet" if getattr(self.pipe, "unet", None) is not None else "transformer"

    def experts(self) -> list[Expert]:
        return [Expert(self.denoiser_name, getattr(self.pipe, self.denoiser_name))]

    def expert_for(self, timestep: float) -> int:
        return 0  # (the index in `experts()` a row at `timestep` runs: one denoiser here)

    @property
    def per_token_timesteps(self) -> bool:
        """Whether the denoiser takes a timestep per latent token (Wan2.2-TI2V)."""
        return False

    def schedulers(self) -> tuple[str, ...]:
        """The scheduler classes the pipeline runs with (its own and those diffusers lists as
        compatible with it)."""
        scheduler = self.pipe.scheduler
        names = {type(scheduler).__name__}
        names.update(c.__name__ for c in getattr(scheduler, "compatibles", ()))
        return tuple(sorted(names))

    def scheduler(self, name: str | None) -> Any:
        """The scheduler a request's `scheduler` names (models/schedulers.py), built from the
        model's own config; None: the model's own."""
        if name is None:
            return self.own_scheduler
        if name not in self._schedulers:
            from vllm_omni_like.models.row_schedulers import make_scheduler

            self._schedulers[name] = make_scheduler(name, self.scheduler_config(name))
        return self._schedulers[name]

    def schedule_args(self, scheduler: Any, steps: int, width: int, height: int) -> dict[str, Any]:
        """What the pipeline passes its scheduler's `set_timesteps` besides the step count for
        an image of `width` x `height` (JSON values): nothing by default."""
        return {}

    def scheduler_config(self, name: str) -> dict[str, Any]:
        """The config a named scheduler is built from: the model's own scheduler's."""
        return dict(self.own_scheduler.config)

    def encode_text(self, texts: list[str | None], device: torch.device, max_length: int) -> Any:
        """Text conditioning, one row per text, as the pipeline encodes a prompt (a negative
        prompt is encoded the same way; None: none was given): the embeddings, or named
        tensors with rows first."""
        raise NotImplementedError(f"{self.family.name}: no text encoding of our own")

    def latent_dtype(self, text_dtype: torch.dtype) -> torch.dtype:
        """The dtype the pipeline keeps its latents in (SD: its text embeddings')."""
        return text_dtype

    def noise(
        self,
        shape: tuple[int, ...],
        generators: Sequence[torch.Generator | None],
        device: torch.device,
        dtype: Any,
    ) -> torch.Tensor:
        """Initial noise, each row drawn from its own generator as a pipeline given a list of
        generators draws it."""
        from diffusers.utils.torch_utils import randn_tensor

        row = (1, *shape[1:])
        return torch.cat(
            [randn_tensor(row, generator=g, device=device, dtype=dtype) for g in generators]
        )

    def text_embed_dim(self) -> int:
        """The width of the text embeddings the denoiser attends to."""
        config = getattr(self.pipe, self.denoiser_name).config
        return int(getattr(config, "text_dim", 0) or 0) or int(config.cross_attention_dim)

    def predict(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text: Any,
        at: Any = None,
        guidance: torch.Tensor | None = None,
    ) -> Any:
        """The denoiser's noise (or velocity) prediction for a batch of model rows, each at its
        own timestep (`timestep`: one per row, on the latents' device; `at`: the same on the
        host, a list of floats, where the loop has them; `guidance`: a DISTILLED family's
        guidance scale of each row, float32 on the device), as the pipeline calls its
        denoiser."""
        raise NotImplementedError(f"{self.family.name}: no denoiser call of our own")

    def guide(
        self, cond: torch.Tensor, uncond: torch.Tensor, scale: float | torch.Tensor
    ) -> torch.Tensor:
        """Classifier-free guidance's combination of the two branches; `scale`: one for all
        rows, or a float32 column of one per row (each product rounded to the branches' dtype,
        as a scalar's is: a row's result is the same either way)."""
        diff = cond - uncond
        if isinstance(scale, torch.Tensor):
            return uncond + (scale * diff).to(diff.dtype)
        return uncond + scale * diff

    def latent_shape(self, rows: int, width: int, height: int, frames: int = 1) -> tuple[int, ...]:
        raise NotImplementedError(f"{self.family.name}: no latents of our own")

    def encode_image(self, pixels: torch.Tensor, generator: torch.Generator | None) -> Any:
        """An image-to-image row's source (1, 3, H, W in [-1, 1]) as its img2img pipeline's
        latents of it, in our loop's layout (models/image_latents.py)."""
        vae = self.pipe.vae
        return image_latents.encode(vae, pixels.to(vae.dtype), generator, vae.dtype)

    def edit_steps(self, steps: int, strength: float) -> tuple[int, int]:
        """(steps, the first one an image-to-image row runs) at `strength`: SD's rule."""
        return image_latents.whole_steps(steps, strength)

    # ---- the pipeline call ------------------------------------------------------------------
    def text_kwargs(
        self, prompts: list[str], negatives: list[str], tokenizer: Any
    ) -> dict[str, Any]:
        """The call's text arguments (prompts, negative prompts and their length)."""
        if self.family.output != "video":
            return {"prompt": prompts, "negative_prompt": negatives}
        kwargs: dict[str, Any] = {"prompt": prompts}
        if any(negatives):
            kwargs["negative_prompt"] = negatives
        kwargs["max_sequence_length"] = tokenizer.model_max_length if tokenizer else 512
        return kwargs

    def guidance_kwargs(
        self, scale: float, params: GenerationParams | None = None
    ) -> dict[str, Any]:
        """The call's guidance arguments for a guidance scale (Qwen-Image: `true_cfg_scale`),
        with what else of the request's `params` the family's call takes (Wan2.2-A14B)."""
        return {"guidance_scale": scale}

    def low_noise_scale(self, params: GenerationParams) -> float | None:
        """A two-expert family's low-noise expert's own scale in `params` (None: one scale)."""
        return None

    def encode_prompt(self, kwargs: dict[str, Any], device: torch.device) -> tuple[Any, ...]:
        """(prompt embeddings, negative prompt embeddings) for a batched-CFG call."""
        raise NotImplementedError(f"{self.family.name}: its guidance is not batched here")

    def media(self, result: Any) -> torch.Tensor:
        """The pipeline call's pixels: (B, C, H, W) images or (B, F, C, H, W) videos."""
        pixels: torch.Tensor = result.frames if self.family.output == "video" else result.images
        return pixels

    def loop_latents(self, latents: torch.Tensor, width: int, height: int) -> torch.Tensor:
        """The pipeline's latents (its call's `output_type="latent"`, its step callback's) for
        a `width` x `height` image, in the layout our loop keeps and `decoder` takes: the same
        by default (FLUX.1 packs 2x2 patches into tokens: unpacked)."""
        return latents

    def load_warning(self) -> str | None:
        """What the stage warns of once loaded (None: nothing)."""
        return None

    @classmethod
    def own_components(cls, path: str) -> dict[str, Any]:
        """Components of the pipeline at `path` this family loads itself (by name), instead of
        the class its model_index.json names."""
        return {}

    # ---- decode, previews, video hooks, edits ----------------------------------------------
    def decoder(self, pipe: Any) -> Decoder | None:
        """The pipeline's own latent decode for `pipe` (this pipeline or an edit variant), done
        here so it can run apart from the denoising; None: the pipeline decodes in its call."""
        return None

    def preview(self, pipe: Any) -> Decoder | None:
        """Decodes a batch's current latents for a partial image; None: no previews."""
        return None

    def chunk_source(self) -> ChunkSource | None:
        return None

    def edit_pipelines(self, stage: str) -> dict[str, Any]:
        """Pipelines sharing this one's models for the `image_conditions` it takes."""
        return {}

    def warm_up_prompts(self, device: torch.device) -> tuple[str | tuple[str, ...], ...]:
        """The prompts a compiled stage warms its own loop up with: one for each text shape its
        denoiser sees (one, unless the family pads prompts to text buckets); a tuple: prompts
        the rows of one batch take in turn (rows of two lengths: a shape of their own)."""
        return ("warm-up",)

    def warmed_up(self) -> None:
        """A compiled stage's warm-up ended: every shape a request may run has been run."""

    def warm_up_modes(self) -> tuple[Mode, ...]:
        """The modes of `edit_pipelines` whose call a compiled stage warms up too, beside its
        first mode's (one request a call, from a blank image): calls over the same denoiser
        that hand it other inputs."""
        return ()

    # ---- speed: the same maths -----------------------------------------------------------------
    def fuse_qkv(self) -> bool:
        """Fuse the denoiser's attention projections into one GEMM; whether it did."""
        return False

    def fast_attention(self) -> str | None:
        """Give the denoiser an attention of the same maths on faster kernels (CUDA, SDPA
        processors); the name of what it did, or None."""
        return None

    def channels_last(self, compiled: bool, forced: bool) -> bool:
        """Lay out the conv nets channels-last where that is faster (`forced`: the user asked
        for it); whether anything changed."""
        return False

    def compile_targets(self) -> list[tuple[Any, str]]:
        """(owner, attribute) of each module to compile: the denoisers by default."""
        return [(self.pipe, expert.name) for expert in self.experts()]

    def high_precision_layers(self) -> tuple[str, ...]:
        """With --quantization fp8, the linear layers of a denoiser (fnmatch patterns over its
        module names) that keep the weights' dtype (models/precision.py)."""
        return DEFAULT_HIGH_PRECISION

    def lora_layers(self) -> tuple[str, ...]:
        """The linear layers of a denoiser a LoRA adapter may target (models/precision.py)."""
        return LORA_LAYERS

    # ---- classifier-free guidance --------------------------------------------------------------
    def batched_cfg(self) -> BatchedCFG | None:
        """Wrap a denoiser called once per branch so both run in one forward; None where the
        pipeline batches them already or the family has no such guidance."""
        return None

    def split_cfg(self, leader: Leader) -> SplitCFG | PairCFG:
        """Rank 0 of CFG-parallel: wrap the denoiser so the branches run on both ranks."""
        raise ValueError(f"CFG-parallel does not run {type(self.pipe).__name__}")

    def keep_for_branches(self) -> set[str]:
        """What rank 1 of CFG-parallel (or of sequence parallelism) keeps: its denoisers."""
        return {expert.name for expert in self.experts()}

    def split_sequence(self, shards: SequenceShards) -> int:
        """Sequence parallelism: make each denoiser (not yet compiled) hold this rank's share of
        its latent tokens and attend over every rank's (text whole, RoPE global); its heads."""
        raise ConfigError(f"sequence parallelism does not run the {self.family.name} family yet")

    def split_decode(self, bands: Bands) -> str | None:
        """Sequence parallelism: make a component's `decode` (every rank calls it at once)
        patch-parallel; the component's name (None: rank 0 decodes alone)."""
        return None


def adapter_for(pipe: Any, family: Family) -> Adapter:
    """The adapter of `family` for the loaded pipeline `pipe`."""
    adapter: Adapter = family.adapter_class()(pipe, family)
    return adapter


def nhwc_unet_and_image_vae(pipe: Any, compiled: bool, forced: bool) -> bool:
    """NHWC for a UNet and an image VAE (AutoencoderKL) where the tensor cores prefer it: when
    compiled (Inductor plans the layouts) or asked for. In eager mode the layout copies around
    each normalisation cost more than the convolutions gain (H200, batch 32 with CFG: UNet
    forward 220 ms NHWC against 185 ms NCHW, VAE decode 516 against 359 ms); compiled, NHWC is
    the faster one (130 against 133 ms)."""
    unet: Any = getattr(pipe, "unet", None)
    vae: Any = getattr(pipe, "vae", None)
    if not (forced or (unet is not None and compiled)):
        return False
    done = False
    if unet is not None:
        unet.to(memory_format=torch.channels_last)
        done = True
    if is_image_vae(vae):
        vae.to(memory_format=torch.channels_last)
        done = True
    return done


def auto_edit_pipelines(pipe: Any, stage: str) -> dict[str, Any]:
    """`Mode.EDIT` (img2img) and 'inpaint' pipelines sharing `pipe`'s models (no second copy), as
    diffusers' auto pipelines map them; a variant the family lacks is left out."""
    import diffusers

    pipes = {}
    for mode, auto in (
        (Mode.EDIT, diffusers.AutoPipelineForImage2Image),
        ("inpaint", diffusers.AutoPipelineForInpainting),
    ):
        try:
            pipes[mode] = auto.from_pipe(pipe)
            pipes[mode].set_progress_bar_config(disable=True)
        except Exception as exc:  # this model has no such variant
            logger.info("stage %s: no %s pipeline (%s)", stage, mode, exc)
    return pipes


def vae_decoder_target(pipe: Any) -> list[tuple[Any, str]]:
    """An image VAE's decoder as a compile target (one call per decode group)."""
    vae = getattr(pipe, "vae", None)
    return [(vae, "decoder")] if is_image_vae(vae) else []


def shifted_vae_decode(pipe: Any, latents: torch.Tensor) -> torch.Tensor:
    """The MMDiT pipelines' decode (FLUX.1's unpacked, SD3's): the latents un-scaled and
    un-shifted by the VAE's config, the VAE, the post-processing."""
    config = pipe.vae.config
    latents = latents.to(pipe.vae.dtype) / config.scaling_factor + config.shift_factor
    image = pipe.vae.decode(latents, return_dict=False)[0]
    pixels: torch.Tensor = pipe.image_processor.postprocess(image, output_type="pt")
    return pixels


def is_image_vae(vae: Any) -> bool:
    return type(vae).__name__ == "AutoencoderKL"


def fuse_unet_qkv(pipe: Any) -> bool:
    """Fuse a UNet pipeline's attention projections (one GEMM instead of three for each
    self-attention); whether it did."""
    if getattr(pipe, "unet", None) is None or not hasattr(pipe, "fuse_qkv_projections"):
        return False
    pipe.fuse_qkv_projections()
    return True


def split_unet_batch(pipe: Any, leader: Leader) -> SplitCFG:
    """CFG-parallel for a UNet pipeline, which doubles its batch: each rank runs one half."""
    wrapper = SplitCFG(pipe.unet, leader)
    pipe.unet = wrapper
    return wrapper


def unet_compile_targets(pipe: Any) -> list[tuple[Any, str]]:
    """A UNet pipeline's compile targets: the UNet, and the image VAE's decoder (one call per
    batch, but compiled it decodes 32 images at 512x512 in 202 ms instead of 359 ms on an
    H200)."""
    return [(pipe, "unet"), *vae_decoder_target(pipe)]
