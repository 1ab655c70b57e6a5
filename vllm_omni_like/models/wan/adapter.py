"""The Wan video family in a worker (Wan2.1 T2V, the tiny video model; Wan2.2's two experts and
per-token timesteps are read from the pipeline's config). Image to video: models/wan/ti2v.py,
models/wan/i2v.py."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from vllm_omni_like.errors import ConfigError
from vllm_omni_like.models.adapter import Adapter, ChunkSource, Decoder, Expert, Guidance
from vllm_omni_like.models.block_stack import BlockStack
from vllm_omni_like.models.columns import to_device
from vllm_omni_like.models.row_conditions import Conditioning
from vllm_omni_like.models.wan import FAMILY
from vllm_omni_like.models.wan.patch_decode import split_wan_decode
from vllm_omni_like.models.wan.sequence_parallel import split_wan
from vllm_omni_like.parallel.branches import BatchedCFG
from vllm_omni_like.parallel.cfg_parallel import Leader, PairCFG
from vllm_omni_like.parallel.patch_decode import Bands
from vllm_omni_like.parallel.ulysses import SequenceShards
from vllm_omni_like.params import GenerationParams


class WanAdapter(Adapter):
    family = FAMILY
    guidance = Guidance.TWO_CALLS  # the pipeline calls its transformer once per branch
    branch_inputs: ClassVar[tuple[str, ...]] = ()  # the transformer's per-row inputs both CFG
    # branches take alike (batched CFG doubles them with the latents)

    def __init__(self, pipe: Any, family: Any = None) -> None:
        super().__init__(pipe, family)
        transformer = getattr(pipe, "transformer", None)  # (a model's `dtype` walks its
        self._dtype = None if transformer is None else transformer.dtype  # modules: at load)
        self.patch_decode = False  # (sequence parallelism: `split_decode`)

    def experts(self) -> list[Expert]:
        """`transformer` alone, or (Wan2.2-A14B) `transformer` for the high-noise steps, from
        timestep `boundary_ratio` x the scheduler's train timesteps on, `transformer_2` below."""
        first = Expert("transformer", self.pipe.transformer)
        second = getattr(self.pipe, "transformer_2", None)
        ratio = self.pipe.config.get("boundary_ratio")
        if second is None or ratio is None:
            return [first]
        boundary = ratio * self.pipe.scheduler.config.num_train_timesteps
        return [Expert("transformer", first.model, boundary), Expert("transformer_2", second)]

    def expert_for(self, timestep: float) -> int:
        """The expert a row at `timestep` runs: `transformer` (0) at or above the boundary,
        `transformer_2` (1) below it (WanPipeline's switch: the boundary still high-noise)."""
        boundary = self.experts()[0].boundary
        return 0 if boundary is None or timestep >= boundary else 1

    def block_stack(self) -> BlockStack:
        """Its blocks, called by position: each row's text (and image) states and timestep
        projection (a timestep a token: Wan2.2-TI2V's) beside the carried latent tokens."""
        if len(self.experts()) > 1:
            raise ConfigError("--cache first-block does not run a two-expert Wan (A14B) yet")
        params = ("hidden_states", "encoder_hidden_states", "temb", "rotary_emb")
        per_row = ("encoder_hidden_states", "temb")
        return BlockStack((self.pipe.transformer.blocks,), params, ("hidden_states",), per_row)

    def guidance_kwargs(
        self, scale: float, params: GenerationParams | None = None
    ) -> dict[str, Any]:
        """WanPipeline's `guidance_scale_2`: the low-noise expert's, from the step it takes over
        (absent: `guidance_scale` throughout)."""
        kwargs = super().guidance_kwargs(scale, params)
        low = None if params is None else self.low_noise_scale(params)
        if low is not None:
            kwargs["guidance_scale_2"] = low
        return kwargs

    def low_noise_scale(self, params: GenerationParams) -> float | None:
        return params.guidance_scale_2

    @property
    def per_token_timesteps(self) -> bool:
        return bool(self.pipe.config.get("expand_timesteps", False))

    def predict(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text: Any,
        at: Any = None,
        guidance: torch.Tensor | None = None,
    ) -> Any:
        """Rows at a timestep on each side of Wan2.2's boundary run their own expert."""
        return self._by_expert(latents, timestep, text, None, at)

    def predict_conditioned(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text: Any,
        conditioning: Conditioning,
        at: Any = None,
    ) -> Any:
        """As `predict`, each row with its own conditioning (`model_inputs`)."""
        return self._by_expert(latents, timestep, text, conditioning, at)

    def _by_expert(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text: Any,
        conditioning: Conditioning | None,
        at: Any,
    ) -> Any:
        experts = self.experts()
        boundary = experts[0].boundary
        if boundary is None:
            return self._call(experts[0].model, latents, timestep, text, conditioning)
        at = at if at is not None else timestep.tolist()  # (the loop gives them: no wait)
        high = [i for i, t in enumerate(at) if self.expert_for(t) == 0]
        low = [i for i, t in enumerate(at) if self.expert_for(t) == 1]
        if not low or not high:
            model = experts[0 if high else 1].model
            return self._call(model, latents, timestep, text, conditioning)
        out = None
        for picked, expert in ((high, experts[0]), (low, experts[1])):
            index = to_device(torch.tensor(picked), latents.device)
            own = None if conditioning is None else {k: v[index] for k, v in conditioning.items()}
            part = self._call(expert.model, latents[index], timestep[index], text[index], own)
            out = part.new_empty((latents.shape[0], *part.shape[1:])) if out is None else out
            out[index] = part
        return out

    def _call(
        self,
        model: Any,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        text: Any,
        conditioning: Conditioning | None,
    ) -> Any:
        hidden, t, more = self.model_inputs(model, latents, timestep, conditioning)
        return model(
            hidden_states=hidden.to(text.dtype),
            timestep=t,
            encoder_hidden_states=text,
            return_dict=False,
            **more,
        )[0]

    def model_inputs(
        self,
        model: Any,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        conditioning: Conditioning | None,
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        """The denoiser's hidden states, timesteps and other inputs for rows of `latents` (and
        their own conditioning, in an image-to-video family): the latents, and one timestep a
        row or (Wan2.2-TI2V) the row's for each of its latent tokens."""
        if not self.per_token_timesteps:
            return latents, timestep, {}
        rows = latents.shape[0]
        p = model.config.patch_size
        tokens = latents.shape[2] // p[0] * (latents.shape[3] // p[1]) * (latents.shape[4] // p[2])
        return latents, timestep.reshape(rows, 1).expand(rows, tokens), {}

    def high_precision_layers(self) -> tuple[str, ...]:
        """FP8: every block's self- and cross-attention projections (an image model's image
        keys and values too) and its MLP. Kept: `condition_embedder` (the timestep MLP, its
        `time_proj` that modulates every block - the blocks' own modulation is a learned table,
        no layer - and the text and image embedders: once a step) and the final `proj_out`
        (the prediction itself)."""
        return ("condition_embedder.*", "proj_out")

    def encode_text(self, texts: list[str | None], device: torch.device, max_length: int) -> Any:
        embeds = self.pipe.encode_prompt(
            prompt=[t or "" for t in texts],
            do_classifier_free_guidance=False,
            max_sequence_length=max_length,
            device=device,
        )[0]
        return embeds.to(self._dtype)  # as the pipeline's call casts them

    def latent_dtype(self, text_dtype: torch.dtype) -> torch.dtype:
        return torch.float32  # WanPipeline.prepare_latents

    def scheduler_config(self, name: str) -> dict[str, Any]:
        """Wan's two schedulers over one flow: UniPC's `flow_shift` is flow-match Euler's
        `shift` (the embedded tiny model ships the latter, Wan2.1 the former)."""
        config = dict(self.own_scheduler.config)
        trained = config.get("num_train_timesteps", 1000)
        if name == "flow-euler" and "flow_shift" in config:
            return {"shift": config["flow_shift"], "num_train_timesteps": trained}
        if name == "unipc" and "flow_shift" not in config:
            return {
                "prediction_type": "flow_prediction",
                "use_flow_sigmas": True,
                "flow_shift": config.get("shift", 1.0),
                "num_train_timesteps": trained,
            }
        return config

    def latent_shape(self, rows: int, width: int, height: int, frames: int = 1) -> tuple[int, ...]:
        pipe = self.pipe
        spatial, temporal = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
        channels = pipe.vae.config.z_dim  # (an image-to-video transformer takes more in)
        return (rows, channels, (frames - 1) // temporal + 1, height // spatial, width // spatial)

    def encode_prompt(self, kwargs: dict[str, Any], device: torch.device) -> tuple[Any, ...]:
        embeds: tuple[Any, ...] = self.pipe.encode_prompt(
            prompt=kwargs.pop("prompt"),
            negative_prompt=kwargs.pop("negative_prompt", None),
            do_classifier_free_guidance=True,
            max_sequence_length=kwargs.get("max_sequence_length", 512),
            device=device,
        )
        return embeds

    def decoder(self, pipe: Any) -> Decoder | None:
        return lambda latents: _decode(pipe, latents)

    def chunk_source(self) -> ChunkSource | None:
        """Wan's VAE decodes a video latent frame by latent frame (one decoder call makes the
        first frame, each later call its temporal factor more): its decoder when it does not
        tile (a tiled decode calls it per tile)."""
        vae = self.pipe.vae
        if vae is None or vae.use_tiling or self.patch_decode:
            return None
        patch = vae.config.patch_size
        return ChunkSource(vae.decoder, lambda out: _chunk_pixels(out, patch))

    def channels_last(self, compiled: bool, forced: bool) -> bool:
        """NDHWC weights for the 3-D VAE: a 832x480 video of 33 frames decodes in 0.675 s
        against 0.744 s (H200; 0.768 against 0.845 s on an H100; at most 6 of 255 levels apart
        in bf16, another choice of cuDNN kernels; `bench/vae_decode.py`)."""
        for module in self.pipe.vae.modules():  # (its 1-D weights refuse `vae.to(memory_format)`)
            if isinstance(module, torch.nn.Conv3d):
                module.weight.data = module.weight.data.contiguous(
                    memory_format=torch.channels_last_3d
                )
        return True

    def batched_cfg(self) -> BatchedCFG | None:
        if len(self.experts()) > 1:  # two experts: each would need its own wrapper
            return None
        wrapper = BatchedCFG(self.pipe.transformer, self.branch_inputs)
        self.pipe.transformer = wrapper
        return wrapper

    def split_cfg(self, leader: Leader) -> PairCFG:
        if len(self.experts()) > 1:
            raise ValueError("CFG-parallel runs one-expert Wan pipelines, not two experts")
        wrapper = PairCFG(self.pipe.transformer, leader)
        self.pipe.transformer = wrapper
        return wrapper

    def split_decode(self, bands: Bands) -> str | None:
        """The VAE's decode, patch-parallel (models/wan/patch_decode.py); its chunks are no
        longer whole frames, so the MP4 is not streamed from them."""
        self.pipe.vae.decode = split_wan_decode(self.pipe.vae, bands)
        self.patch_decode = True
        return "vae"

    def split_sequence(self, shards: SequenceShards) -> int:
        """Each expert's tokens split (models/wan/sequence_parallel.py); its heads."""
        for expert in self.experts():
            split_wan(expert.model, shards)
        return int(self.pipe.transformer.config.num_attention_heads)


def _decode(pipe: Any, latents: torch.Tensor) -> torch.Tensor:
    """WanPipeline's decode: un-normalised latents through the VAE, then post-processing."""
    vae = pipe.vae
    latents = latents.to(dtype=vae.dtype)
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents.device, latents.dtype)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(
        latents.device, latents.dtype
    )
    video = vae.decode(latents / inverse_std + mean, return_dict=False)[0]
    frames: torch.Tensor = pipe.video_processor.postprocess_video(video, output_type="pt")
    return frames


def _chunk_pixels(out: torch.Tensor, patch_size: int | None) -> torch.Tensor:
    """One decoder call's output (B, C, t, H, W) in model units -> uint8 (B, t, H, W, 3) on the
    device: the VAE's own clamp, the video processor's denormalize, `tensor_to_uint8`'s maths
    (the ops commute with cutting the frames into chunks, so the frames and the MP4's bytes are
    those of encoding the finished video)."""
    if patch_size is not None:
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        out = unpatchify(out, patch_size=patch_size)
    frames = torch.clamp(out, min=-1.0, max=1.0).permute(0, 2, 1, 3, 4)
    frames = (frames * 0.5 + 0.5).clamp(0, 1)
    pixels = (frames.float().clamp(0, 1) * 255).round().to(torch.uint8)
    return pixels.movedim(-3, -1)


ADAPTER = WanAdapter
