"""Diffusion stage: any diffusers pipeline from a local directory (text-to-image, edit, video).

What differs between model families is asked of the pipeline's adapter (models/adapter.py);
this module names no model class."""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import torch

from vllm_omni_like.config import parse_size
from vllm_omni_like.errors import InvalidRequestError
from vllm_omni_like.models import limits as model_limits
from vllm_omni_like.models.adapter import adapter_for
from vllm_omni_like.models.registry import family_of, loops_for
from vllm_omni_like.models.tiny import TINY_NAMES, ensure_tiny_model
from vllm_omni_like.parallel import cfg_parallel
from vllm_omni_like.parallel.branches import BatchedCFG
from vllm_omni_like.parallel.rank_link import Link
from vllm_omni_like.stage_options import DiffusionOptions
from vllm_omni_like.stages.base import Deferred, RowStepper, StageControl
from vllm_omni_like.stages.diffusion import acceleration as accel
from vllm_omni_like.stages.diffusion.host_scheduler import host_scheduler
from vllm_omni_like.stages.diffusion.own_loop import OwnLoop
from vllm_omni_like.stages.diffusion.pipeline_call import PipelineCall
from vllm_omni_like.stages.diffusion.prompt_length import check_prompt_length
from vllm_omni_like.stages.diffusion.running_set import OwnLoopSet
from vllm_omni_like.stages.diffusion.step import DenoiseLoop
from vllm_omni_like.stages.torch_utils import (
    BatchDimProbe,
    check_model_dir,
    dummy_pipeline,
    quiet_loading,
    resolve_device,
    resolve_dtype,
)
from vllm_omni_like.stages.trace import BatchTracer
from vllm_omni_like.wire import Mode, StageRequest

logger = logging.getLogger(__name__)


class DiffusionStage(OwnLoop, PipelineCall):
    """Runs text2img / edit (img2img or inpaint, same components) / text2video batches: each
    mode through our own loop (own_loop.py) or the pipeline's call (pipeline_call.py)."""

    options_type = DiffusionOptions

    # 1. load -----------------------------------------------------------------------------------
    def load(self, device: str) -> None:
        import diffusers

        opts = self.options
        quiet_loading()
        path = self.config.model or "tiny-image"
        if path in TINY_NAMES:
            path = ensure_tiny_model(path)
        check_model_dir(path, "model_index.json")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(self.config.dtype, self.device, torch.float16)
        self.link = self._connect_ranks()
        self.tracer = BatchTracer(self.name, self.ranks.rank, self.device)
        self._check_text_encoder(path)
        self.family = family_of(path)
        own = self.family.adapter_class().own_components(path)
        if self.config.load_format == "dummy":
            pipe = dummy_pipeline(path, self.device, self.dtype, own)
        else:
            pipe = diffusers.DiffusionPipeline.from_pretrained(
                path, local_files_only=True, dtype=self.dtype, **own
            )
        pipe.set_progress_bar_config(disable=True)
        self.pipe = pipe.to(self.device)
        accel.pin_execution_device(pipe, self.device)
        self.adapter = adapter = adapter_for(pipe, self.family)
        if (warning := adapter.load_warning()) is not None:
            logger.warning("stage %s: %s", self.name, warning)
        self.is_video = self.family.output == "video"
        self._say_experts()
        # per mode: our own denoising loop, or the pipeline's call (and why)
        self.loops = loops_for(path, self.config.cfg_parallel)
        self.own = {mode for mode, (loop, _) in self.loops.items() if loop == "own"}
        for mode, (_, why) in self.loops.items():
            if mode in self.family.own_loop and why is not None:
                logger.warning("stage %s: %s runs the pipeline's call: %s", self.name, mode, why)
        self.denoiser = getattr(pipe, adapter.denoiser_name)
        self.denoiser_dtype = self.denoiser.dtype  # (a model's `dtype` walks its modules)
        self.tokenizer = getattr(pipe, "tokenizer", None)
        self.embed_shape = self._random_embeddings_shape(pipe)
        self.limits = model_limits.diffusion_limits(self.config)
        self.default_width = self.limits.default_width
        self.default_height = self.limits.default_height
        self.default_steps = self.limits.default_steps
        guidance = opts.default_guidance
        self.default_guidance = guidance if guidance is not None else self.family.default_guidance
        self.default_frames = self.limits.default_frames or 9
        # speed: kernels, memory format, compilation (none of them changes the maths)
        config = self.config
        self.attention = accel.set_attention(pipe, config.attention, self.device, self.name)
        self.channels_last = accel.use_channels_last(
            adapter, config.channels_last, self.device, compiled=config.compile
        )
        self.tuned = accel.tune_kernels(
            adapter, self.device, sdpa=self.attention == "sdpa", compiled=config.compile
        )
        pipeline_loop = set(self.family.modes) - self.own
        if pipeline_loop and host_scheduler(pipe):  # the same steps, none waiting on the device
            self.tuned.append("UniPC coefficients on the host")
        self.scheduler = pipe.scheduler  # the pipeline call's default
        logger.info(
            "stage %s: attention %s, channels_last %s, %s",
            self.name,
            self.attention,
            self.channels_last,
            ", ".join(self.tuned) or "default kernels",
        )
        self.buckets: tuple[int, ...] = ()
        if config.compile:
            backend = opts.compile_backend
            compiled = accel.compile_models(adapter, config.compile_mode, backend)
            logger.info("stage %s: compiled %s (%s)", self.name, ", ".join(compiled), backend)
            configured = config.batch_buckets or opts.batch_buckets
            self.buckets = accel.buckets_for(config.max_batch_size, configured)
        self.denoise = DenoiseLoop(
            adapter,
            self.device,
            self._embed,
            accel.model_row_buckets(adapter, self.buckets, config.batched_cfg),
            config.batched_cfg,
        )
        self.leader: cfg_parallel.Leader | None = None
        self.cfg: BatchedCFG | cfg_parallel.SplitCFG | None = None
        self.branch_model = getattr(pipe, adapter.denoiser_name)  # rank 1's, compiled or not
        if self.link is not None and self.ranks.rank > 0:  # rank 1 runs its denoiser only
            cfg_parallel.keep_only(pipe, adapter.keep_for_branches())
            self.follower = cfg_parallel.Follower(self.link)
            if config.compile:
                self.serve_branches(cfg_parallel.WARM_UP)  # rank 0's warm-up compiles its own
            return
        if self.link is not None:
            self.leader = cfg_parallel.Leader(self.link, self.tracer.mark)
            self.cfg = adapter.split_cfg(self.leader)
        elif config.batched_cfg and self.family.modes[0] not in self.own:  # (our loop batches)
            self.cfg = adapter.batched_cfg()
        self.probe = BatchDimProbe()  # on the model itself: it sees the batch the kernels get
        model = getattr(pipe, adapter.denoiser_name)
        self.probe.attach(self.cfg.model if self.cfg is not None else model)
        self.edit_pipes = adapter.edit_pipelines(self.name)
        # the decode of a deferred batch runs here, beside the next batch's steps
        self.side_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        if config.compile:
            self._warm_up()
            self.end_branches(cfg_parallel.WARM_UP)

    def _connect_ranks(self) -> Link | None:
        """CFG-parallel: meet the other rank first (it loads meanwhile); the process group's
        timeout is a backstop behind the executor's death and stall detection."""
        config = self.config
        if not config.cfg_parallel:
            return None
        backstop = (
            max(config.load_timeout, config.compile_timeout, config.cold_timeout)
            + config.stall_timeout
        )
        return Link(self.ranks, self.device, backstop)

    def serve_branches(self, batch_id: int) -> None:
        assert self.link is not None, "serve_branches on a stage without CFG-parallel ranks"
        with self.tracer.batch():
            self.follower.serve(self.branch_model, batch_id, self.tracer.mark)

    def end_branches(self, batch_id: int) -> None:
        if self.leader is not None:
            self.leader.end(batch_id)

    def _say_experts(self) -> None:
        """A model of two experts (Wan2.2-A14B) says at start-up where each is (none is
        offloaded: both must fit the device; an H200 holds the A14B pair)."""
        experts = self.adapter.experts()
        if len(experts) > 1:
            where = ", ".join(f"{e.name} on {next(e.model.parameters()).device}" for e in experts)
            boundary = experts[0].boundary
            logger.info(
                "stage %s: two experts switched at timestep %g: %s (none offloaded)",
                self.name,
                boundary,
                where,
            )

    def _check_text_encoder(self, path: str) -> None:
        with open(os.path.join(path, "model_index.json")) as f:
            entry = json.load(f).get("text_encoder", ["present"])
        if entry[0] is None and self.config.load_format != "dummy":
            raise FileNotFoundError(
                f"{self.config.model!r} has no text encoder; only --load-format dummy "
                "runs it (on seeded random prompt embeddings)"
            )

    def _random_embeddings_shape(self, pipe: Any) -> tuple[int, int] | None:
        """A dummy model without its text encoder gets seeded random prompt embeddings."""
        if "text_encoder" not in pipe.components or pipe.text_encoder is not None:
            return None
        return self.options.max_sequence_length, self.adapter.text_embed_dim()

    def _warm_up(self) -> None:
        """Compile now, for every warm-up size and batch bucket, so no request pays for it."""
        sizes = [parse_size(s) for s in self.config.warmup_sizes] or [
            (self.default_width, self.default_height)
        ]
        started, shapes = time.monotonic(), 0
        for width, height in sizes:
            for rows in self.buckets:
                if self.family.modes[0] in self.own:  # batches of `rows` through our own loop
                    shapes += self._warm_up_own(rows, width, height)
                else:
                    self._warm_up_call(rows, width, height)
                    shapes += 1
                logger.info("stage %s: warmed up %dx%d x%d", self.name, width, height, rows)
            for mode in self.adapter.warm_up_modes():  # (their calls take one request a call)
                self._warm_up_call(accel.bucket_for(1, self.buckets), width, height, mode)
                logger.info(
                    "stage %s: warmed up %dx%d from an image (%s)", self.name, width, height, mode
                )
        logger.info(
            "stage %s: compiled and warmed up %d shapes in %.1fs",
            self.name,
            shapes,
            time.monotonic() - started,
        )
        accel.log_recompiles()

    # 2. validate (before batching) ---------------------------------------------------------------
    def validate(self, request: StageRequest) -> None:
        p = request.params
        if request.mode in (Mode.TEXT2VIDEO, Mode.IMAGE2VIDEO) and not self.is_video:
            raise InvalidRequestError("this model makes images, not videos", stage=self.name)
        if request.mode in (Mode.TEXT2IMG, Mode.EDIT) and self.is_video:
            raise InvalidRequestError("this model makes videos, not images", stage=self.name)
        if request.mode not in self.family.modes:  # (text alone to an image-only model, or
            if not self.family.needs_image:  # an image to a text-to-video one)
                raise InvalidRequestError("this model makes videos from text only", stage=self.name)
            what = "makes videos from an image" if self.is_video else "edits an input image"
            raise InvalidRequestError(f"this model {what}: send it one", stage=self.name)
        if request.mode == Mode.EDIT and Mode.EDIT not in self.edit_pipes:
            raise InvalidRequestError("this model does not support image edits", stage=self.name)
        if (
            request.mode == Mode.EDIT
            and request.mask is not None
            and "inpaint" not in self.edit_pipes
        ):
            raise InvalidRequestError("this model's edits take no mask", stage=self.name)
        experts = len(self.adapter.experts())
        model_limits.check_expert_scales(p, experts, "this model", stage=self.name)
        if request.mode == Mode.EDIT and p.strength is not None and not self.family.edit_strength:
            raise InvalidRequestError(
                "this model edits by instruction and takes no strength", stage=self.name
            )
        lim = self.limits
        if p.width is not None or p.height is not None:
            size = (p.width or self.default_width, p.height or self.default_height)
            lim.check_size(self.config.model or "the model", *size)
        steps = p.num_inference_steps
        if steps is not None and not lim.min_steps <= steps <= lim.max_steps:
            raise InvalidRequestError(
                f"num_inference_steps must be within {lim.min_steps}..{lim.max_steps}",
                stage=self.name,
                param="num_inference_steps",
            )
        if p.num_frames is not None and not 1 <= p.num_frames <= (lim.max_frames or 1):
            raise InvalidRequestError(
                f"num_frames must be within 1..{lim.max_frames}",
                stage=self.name,
                param="num_frames",
            )
        lim.check_scheduler(self.config.model or "the model", p.scheduler)
        check_prompt_length(self.tokenizer, request, self.name)

    # 3. execute -----------------------------------------------------------------------------------
    def begin(self, batch: list[StageRequest], control: StageControl) -> Deferred:
        """The denoising loop; the returned part decodes (on the side stream) when finished."""
        if batch[0].mode in self.own:
            media, seeds, frames = self._denoise_own(batch, control)
            return self.defer(batch, media, seeds, frames, self.adapter.decoder(self.pipe))
        pipe, kwargs, _, seeds = self._prepare(batch, control)
        decoder = self.adapter.decoder(pipe)
        if decoder is not None:
            kwargs["output_type"] = "latent"
        media = self.adapter.media(self._denoise(pipe, kwargs, control))
        if decoder is not None:  # (latents, in our loop's layout)
            media = self.adapter.loop_latents(media, kwargs["width"], kwargs["height"])
        frames = kwargs.get("num_frames", 0)  # a video's, as the pipeline was asked
        return self.defer(batch, media, seeds, frames, decoder)

    def stepped_modes(self) -> tuple[Mode, ...]:
        return tuple(sorted(self.own)) if self.link is None else ()

    def stepper(self, mode: Mode) -> RowStepper | None:
        """Our own loop's modes run as a running set (running_set.py); a pipeline call cannot."""
        return OwnLoopSet(self) if mode in self.stepped_modes() else None

    def close(self) -> None:
        if self.link is not None:
            self.link.close()
        del self.pipe
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
