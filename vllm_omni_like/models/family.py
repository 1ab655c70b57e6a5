"""What a model family is, torch-free: which diffusers pipelines it runs, what it makes, its
geometry, and where its adapter (the torch side: models/<family>/adapter.py) lives.

The API process (admission, `/v1/models`, `/health`) and the worker read the same description,
chosen once from a model directory's `model_index.json` (models/registry.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from vllm_omni_like.wire import Mode

Config = dict[str, Any]
Loop = Literal["own", "pipeline"]  # which denoising loop a mode's batches run (registry.py)


def vae_factors_by_blocks(vae: Config) -> tuple[int, int | None]:
    """An image VAE (AutoencoderKL): one halving per block after the first; no time axis."""
    return 2 ** (len(vae.get("block_out_channels", [0, 0, 0, 0])) - 1), None


def takes_no_mask(denoiser: Config, vae: Config) -> bool:
    """A family whose denoisers take their latents alone (every family but the UNets')."""
    return False


@dataclass(frozen=True)
class Family:
    """One family of diffusion models: the description the whole server shares.

    `size_base`: what the pipeline's own `check_inputs` asks width and height to be multiples
    of (the VAE's factor times the patch size is added by the limits). `vae_factors`: the
    VAE's (spatial, temporal) factors from its config. `own_loop`: the modes whose batches
    run our own denoising loop (stages/diffusion/step.py: rows with their own steps, guidance,
    scheduler and seed); other modes run the diffusers pipeline's own `__call__`, whole
    requests of one step loop batched together. `schedulers`: the names (models/schedulers.py)
    a request may pick from. `adapter`: the module whose `ADAPTER` class runs the family in a
    worker. `presets`: the architecture configs shipped without weights (assets/archs) that
    the family serves, by name, each with the stage options it is served with (its published
    steps, sizes, frames...), less what the family says already (`default_guidance`).
    """

    name: str
    pipelines: tuple[str, ...]  # model_index.json `_class_name`s it runs
    output: str  # image | video
    size_base: int
    default_guidance: float
    adapter: str
    vae_factors: Callable[[Config], tuple[int, int | None]] = field(default=vae_factors_by_blocks)
    own_loop: tuple[Mode, ...] = ()
    schedulers: tuple[str, ...] = ()
    default_frames: int | None = None  # videos: frames when neither request nor options say
    native_side: int | None = None  # images: the side it draws by default where neither its
    # denoiser's config nor its VAE's says (Qwen-Image: 1024)
    needs_image: bool = False  # it only edits an input image (Qwen-Image-Edit, an image-to-
    # video model): no generation from text alone
    edit_strength: bool = True  # its edits take a strength (img2img); False: by instruction
    video_from_image: bool = False  # a video model that also starts from an image (TI2V)
    inpaints: bool = False  # its edits also take a mask (Mode.INPAINT: an edit with one)
    config_flag: str | None = None  # a model_index.json value that must be true for this
    # family (a pipeline class shared by two families: Wan2.2-TI2V's `expand_timesteps`)
    # whether a model's denoiser (by its config and its VAE's) takes an inpainting row's mask
    # and masked image's latents beside its latents (SD's 9-channel UNets): it inpaints only
    takes_mask: Callable[[Config, Config], bool] = field(default=takes_no_mask)
    fp8: bool = False  # its denoisers' linear layers run FP8 matmuls with --quantization fp8
    # (which of them stay in the weights' dtype: its adapter's `high_precision_layers`)
    fp8_attention: bool = False  # --attention fp8 runs its attention: its processors call
    # diffusers' dispatch, unmasked or with a key-padding mask (SD3's call SDPA themselves)
    step_cache: bool = False  # --cache first-block runs it (its adapter's `block_stack`)
    presets: Mapping[str, Config] = field(default_factory=dict, hash=False)

    def adapter_class(self) -> Any:
        """The torch side (imports torch and diffusers)."""
        return importlib.import_module(self.adapter).ADAPTER

    def preset(self, arch: str) -> Config:
        """The stage options the shipped architecture `arch` is served with: its preset, at
        the family's default guidance where the preset sets none."""
        return {"default_guidance": self.default_guidance, **self.presets[arch]}

    @property
    def modes(self) -> tuple[Mode, ...]:
        if self.output == "video":
            if self.needs_image:
                return (Mode.IMAGE2VIDEO,)
            if self.video_from_image:
                return (Mode.TEXT2VIDEO, Mode.IMAGE2VIDEO)
            return (Mode.TEXT2VIDEO,)
        if self.needs_image:
            return (Mode.EDIT,)
        return (
            (Mode.TEXT2IMG, Mode.EDIT, Mode.INPAINT)
            if self.inpaints
            else (Mode.TEXT2IMG, Mode.EDIT)
        )

    def modes_of(self, denoiser: Config, vae: Config) -> tuple[Mode, ...]:
        """The modes one model of the family runs, from its denoiser's and VAE's configs: a
        denoiser that takes a mask inpaints only (an edit with a mask: `StageRequest.loop_mode`
        INPAINT); any other, the family's `modes`. The API process (`/v1/models`, admission,
        `/health`'s loops) and the stage (`Adapter.takes_mask`) ask the same `takes_mask`."""
        return (Mode.INPAINT,) if self.takes_mask(denoiser, vae) else self.modes
