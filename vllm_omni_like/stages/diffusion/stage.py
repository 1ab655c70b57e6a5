"""Diffusion stage: any diffusers pipeline from a local directory (text-to-image, edit, video).

What differs between model families is asked of the pipeline's adapter (models/adapter.py);
this module names no model class."""

from __future__ import annotations

import logging
import time

import torch

from vllm_omni_like.config import parse_size
from vllm_omni_like.errors import InvalidRequestError
from vllm_omni_like.models import limits as model_limits
from vllm_omni_like.parallel import cfg_parallel
from vllm_omni_like.stage_options import DiffusionOptions
from vllm_omni_like.stages.base import Deferred, RowStepper, Stage, StageControl
from vllm_omni_like.stages.diffusion import acceleration as accel
from vllm_omni_like.stages.diffusion.load import load_runtime
from vllm_omni_like.stages.diffusion.own_loop import OwnLoop
from vllm_omni_like.stages.diffusion.pipeline_call import PipelineCall
from vllm_omni_like.stages.diffusion.prompt_length import check_prompt_length
from vllm_omni_like.stages.diffusion.running_set import OwnLoopSet
from vllm_omni_like.stages.diffusion.runtime import DiffusionRuntime
from vllm_omni_like.wire import Mode, OffloadReport, StageRequest

logger = logging.getLogger(__name__)


class DiffusionStage(Stage):
    """Runs text2img / edit (img2img or inpaint, same components) / text2video batches: each
    mode through our own loop (own_loop.py) or the pipeline's call (pipeline_call.py), both
    given the runtime the load built (runtime.py)."""

    options_type = DiffusionOptions
    options: DiffusionOptions
    runtime: DiffusionRuntime
    own_loop: OwnLoop
    pipeline_call: PipelineCall

    # 1. load -----------------------------------------------------------------------------------
    def load(self, device: str) -> None:
        # 1) the model and what runs it (load.py), given to both loops
        self.runtime = runtime = load_runtime(self.config, self.options, self.ranks, device)
        self.own_loop = OwnLoop(runtime)
        self.pipeline_call = PipelineCall(runtime)
        # 2) compiled: every warm-up shape now, so no request pays for it
        if self.config.compile:
            if self.ranks.rank > 0 and self.config.leads:
                self.serve_branches(cfg_parallel.WARM_UP)  # rank 0's warm-up compiles its own
            else:
                self._warm_up()
                self.end_branches(cfg_parallel.WARM_UP)
            runtime.adapter.warmed_up()
        runtime.tracer.serving()

    def serve_branches(self, batch_id: int) -> None:
        """A rank > 0: serve rank 0's calls of batch `batch_id` (its CFG branches, or its
        sequence-parallel forwards; its group's leader's) until rank 0 (that leader) ends it."""
        rt = self.runtime
        with rt.tracer.batch():
            if rt.seq_ranks is not None and rt.seq_ranks.follower is not None:
                rt.seq_ranks.follower.serve(rt.seq_ranks.models, batch_id)
                return
            assert rt.cfg_ranks is not None and rt.cfg_ranks.follower is not None, (
                "serve_branches on a stage that is no CFG-parallel rank 1"
            )
            rt.cfg_ranks.follower.serve(rt.cfg_ranks.branch_model, batch_id, rt.tracer.mark)
            if rt.seq_ranks is not None and rt.seq_ranks.leader is not None:
                rt.seq_ranks.leader.end(batch_id)  # (it led its group's forwards of the batch)

    def end_branches(self, batch_id: int) -> None:
        for ranks in (self.runtime.cfg_ranks, self.runtime.seq_ranks):
            if ranks is not None and ranks.leader is not None:
                ranks.leader.end(batch_id)

    def _warm_up(self) -> None:
        """Compile now, for every warm-up size and batch bucket, so no request pays for it."""
        rt = self.runtime
        sizes = [parse_size(s) for s in self.config.warmup_sizes] or [
            (rt.defaults.width, rt.defaults.height)
        ]
        started = time.monotonic()
        with rt.denoise.graphs.warm_up():  # (a bucket's second forward is captured)
            shapes = self._warm_up_sizes(sizes)
        logger.info(
            "stage %s: compiled and warmed up %d shapes in %.1fs",
            self.name,
            shapes,
            time.monotonic() - started,
        )
        if graphs := rt.denoise.graphs.labels():
            memory = rt.denoise.graphs.memory() / 2**20
            logger.info(
                "stage %s: CUDA graphs of %s (%.0f MiB)", self.name, ", ".join(graphs), memory
            )
        accel.log_recompiles()

    def _warm_up_sizes(self, sizes: list[tuple[int, int]]) -> int:
        """Every warm-up size and batch bucket through the loop that runs it; the shapes."""
        rt, shapes = self.runtime, 0
        for width, height in sizes:
            for rows in rt.buckets:
                if next(iter(rt.loops)) in rt.own:  # batches of `rows` through our own loop
                    shapes += self.own_loop.warm_up(rows, width, height)
                else:
                    self.pipeline_call.warm_up(rows, width, height)
                    shapes += 1
                logger.info("stage %s: warmed up %dx%d x%d", self.name, width, height, rows)
            for mode in rt.adapter.warm_up_modes():  # (their calls take one request a call)
                self.pipeline_call.warm_up(accel.bucket_for(1, rt.buckets), width, height, mode)
                logger.info(
                    "stage %s: warmed up %dx%d from an image (%s)", self.name, width, height, mode
                )
        return shapes

    # 2. validate (before batching) ---------------------------------------------------------------
    def _check_edit(self, request: StageRequest) -> None:
        """What the model's edits take (an inpainting UNet of 9 channels: inpainting only)."""
        rt = self.runtime
        if request.mode == Mode.EDIT and Mode.EDIT not in rt.edit_pipes:
            raise InvalidRequestError("this model does not support image edits", stage=self.name)
        if (
            request.mode == Mode.EDIT
            and request.mask is not None
            and "inpaint" not in rt.edit_pipes
        ):
            raise InvalidRequestError("this model's edits take no mask", stage=self.name)
        if rt.adapter.takes_mask() and request.loop_mode != Mode.INPAINT:
            raise InvalidRequestError(
                "this model's UNet inpaints only: send an image and a mask", stage=self.name
            )

    def validate(self, request: StageRequest) -> None:
        rt, p = self.runtime, request.params
        family, is_video = rt.family, rt.is_video
        if request.mode in (Mode.TEXT2VIDEO, Mode.IMAGE2VIDEO) and not is_video:
            raise InvalidRequestError("this model makes images, not videos", stage=self.name)
        if request.mode in (Mode.TEXT2IMG, Mode.EDIT) and is_video:
            raise InvalidRequestError("this model makes videos, not images", stage=self.name)
        if request.mode not in family.modes:  # (text alone to an image-only model, or
            if not family.needs_image:  # an image to a text-to-video one)
                raise InvalidRequestError("this model makes videos from text only", stage=self.name)
            what = "makes videos from an image" if is_video else "edits an input image"
            raise InvalidRequestError(f"this model {what}: send it one", stage=self.name)
        self._check_edit(request)
        experts = len(rt.adapter.experts())
        model_limits.check_expert_scales(p, experts, "this model", stage=self.name)
        if request.mode == Mode.EDIT and p.strength is not None and not family.edit_strength:
            raise InvalidRequestError(
                "this model edits by instruction and takes no strength", stage=self.name
            )
        lim = rt.limits
        if p.width is not None or p.height is not None:
            size = (p.width or rt.defaults.width, p.height or rt.defaults.height)
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
        check_prompt_length(rt.text.tokenizer, request, self.name)
        self._check_cache(request)
        if p.loras:
            self._validate_loras(request)

    def _check_cache(self, request: StageRequest) -> None:
        """A request's own cache threshold needs a step cache on the loop that runs it."""
        rt = self.runtime
        if request.params.cache_threshold is None:
            return
        if rt.denoise.cache is None or request.loop_mode not in rt.own:
            raise InvalidRequestError(
                "this model runs no step cache for this request (its stage is served without "
                "--cache first-block, or the mode runs the pipeline's own call): send no cache",
                stage=self.name,
                param="cache",
            )

    def _validate_loras(self, request: StageRequest) -> None:
        """A request's LoRA adapters: served here, on our own loop, each read and checked (a
        broken file fails this request alone)."""
        rt, pool = self.runtime, self.runtime.denoise.loras
        if pool is None:
            raise InvalidRequestError(
                "this model serves no LoRA adapters (--lora, --lora-dir)", param="lora"
            )
        if request.loop_mode not in rt.own:
            raise InvalidRequestError(
                f"LoRA adapters run on our own loop; this model's {request.loop_mode} runs the "
                "pipeline's call",
                param="lora",
            )
        pool.check_request(request.params.loras, self.name)

    # 3. execute -----------------------------------------------------------------------------------
    def begin(self, batch: list[StageRequest], control: StageControl) -> Deferred:
        """The denoising loop; the returned part decodes (on the side stream) when finished."""
        if batch[0].loop_mode in self.runtime.own:
            return self.own_loop.begin(batch, control)
        return self.pipeline_call.begin(batch, control)

    def precision(self) -> str | None:
        return self.runtime.precision

    def cuda_graphs(self) -> tuple[tuple[str, ...], int]:
        graphs = self.runtime.denoise.graphs
        return graphs.labels(), graphs.memory()

    def offload(self) -> OffloadReport | None:
        offload = self.runtime.denoise.offload
        return None if offload is None else offload.report()

    def stepped_modes(self) -> tuple[Mode, ...]:
        return tuple(sorted(self.runtime.own))

    def stepper(self, mode: Mode) -> RowStepper | None:
        """Our own loop's modes run as a running set (running_set.py); a pipeline call cannot."""
        if mode not in self.stepped_modes():
            return None
        return OwnLoopSet(self.runtime, defer_reads=True)  # (rows wait for their LoRA files)

    def close(self) -> None:
        if self.runtime.denoise.loras is not None:
            self.runtime.denoise.loras.reads.close()
        for ranks in (self.runtime.cfg_ranks, self.runtime.seq_ranks):
            if ranks is not None:
                ranks.link.close()
        # what load built goes (the models with it, where nothing else holds them)
        del self.runtime, self.own_loop, self.pipeline_call
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
