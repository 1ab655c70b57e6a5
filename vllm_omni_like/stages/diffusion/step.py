"""One denoising step of rows with their own steps, scheduler, guidance scale and seed.

A batch's text is encoded once on entry (each distinct prompt and negative prompt once); each
row's noise comes from its own generator. Each step runs one forward over every live row's
conditional branch and the unconditional branch of the rows with guidance (model rows: two per
CFG row, one otherwise; a compiled denoiser pads them to its warmed-up bucket; CFG-parallel: the
unconditional rows' forward on rank 1 meanwhile, `branches`), combines each CFG row with its own
scale, and steps every row with its own scheduler (models/row_schedulers.py: one vectorised
update a kind, no `step()` per row). A row that ends its steps, or whose request is aborted,
leaves the forward; the loop ends when none is left. A row equals that row run alone (a batched
matmul may round differently: test_step.py bounds it). The latents go to the deferred decode.

A row from an image (an instruction edit, image to video) carries its own conditioning, made
once when it joins (`conditions`) and kept row by row beside the latents: each forward takes its
model rows' (both CFG branches alike), and each step puts back what it fixes (TI2V's first
frame). Where the family's text reads the image (Qwen2.5-VL), a text row is its prompt's with
its request's upload.

With `--cache first-block` each row carries its own step cache (`LoopRow.cache`, empty when it
joins), handed its model rows' (row, branch) each forward to decide on the blocks after the first.

A row's LoRA adapters (lora_pool.py): each forward hands the pool's layers its model rows'
slots and scales (the unconditional branch its row's) as device tensors.

What differs between families is the adapter's (models/adapter.py): `encode_text`, `noise`,
`latent_dtype`, `predict`, `guide`, `scheduler`; for rows from an image `condition`,
`predict_conditioned`, `put_back` (models/row_conditions.py).
"""

from __future__ import annotations

import dataclasses
import random
from contextlib import nullcontext
from typing import Any

import torch

from vllm_omni_like.models import row_schedulers as rs
from vllm_omni_like.models.adapter import Adapter, Guidance
from vllm_omni_like.models.columns import column, to_device
from vllm_omni_like.models.row_conditions import Conditioning
from vllm_omni_like.parallel.cfg_parallel import LoopBranches
from vllm_omni_like.params import DEFAULT_STRENGTH
from vllm_omni_like.stages.diffusion import edit_rows
from vllm_omni_like.stages.diffusion.acceleration import bucket_for
from vllm_omni_like.stages.diffusion.block_cache import FirstBlockCache, RowCache, cache_pass
from vllm_omni_like.stages.diffusion.edit_rows import Source
from vllm_omni_like.stages.diffusion.graphs import GraphRunner, Inputs
from vllm_omni_like.stages.diffusion.loop_rows import Embed, LoopRow, Plan, Settings, TextKey
from vllm_omni_like.stages.diffusion.lora_pool import LoraPool, LoraRows
from vllm_omni_like.stages.diffusion.offload import ExpertOffload
from vllm_omni_like.stages.diffusion.row_tensors import (
    Text,
    cat_named,
    cat_rows,
    pad_each,
    row_index,
    take,
    take_named,
)
from vllm_omni_like.wire import StageRequest


class DenoiseLoop:
    def __init__(
        self,
        adapter: Adapter,
        device: torch.device,
        embed: Embed,
        buckets: tuple[int, ...] = (),
        batched_cfg: bool = True,
        loras: LoraPool | None = None,
        graphs: GraphRunner | None = None,
    ) -> None:
        self.adapter = adapter
        self.loras = loras  # the stage's LoRA pool (None: it serves no adapter)
        self.device = device
        self.embed = embed
        self.buckets = buckets  # model rows a compiled denoiser was warmed up for
        self.batched_cfg = batched_cfg  # False: the two branches in two forwards
        # each bucket's forward replayed from a CUDA graph (graphs.py); none: run as it is
        self.graphs = graphs or GraphRunner()
        # host timesteps for the adapter only where it chooses an expert by them (Wan2.2:
        # `Adapter.expert_for`)
        self.host_times = len(adapter.experts()) > 1
        # a guidance embedding (FLUX.1): each row's scale goes into its one forward, no CFG
        self.distilled = adapter.guidance is Guidance.DISTILLED
        # --cache first-block (block_cache.py; installed by the load), and its rows' threshold
        self.cache: FirstBlockCache | None = None
        self.cache_threshold = 0.0
        # CFG-parallel's rank 0 (parallel/cfg_parallel.py, installed by the load): each step's
        # unconditional forward on rank 1, beside the conditional one here
        self.branches: LoopBranches | None = None
        self.offload: ExpertOffload | None = None  # --offload idle-expert (offload.py; load's)

    # ---- entry --------------------------------------------------------------------------------
    def rows(
        self, batch: list[StageRequest], settings: Settings, size: tuple[int, int] = (0, 0)
    ) -> tuple[list[LoopRow], Any]:
        """Each request's rows (`n` images, or one video), and the batch's text conditioning:
        each distinct prompt once, then each distinct negative prompt once, in two encoder
        calls as a pipeline makes them (a batch's rounding then is the pipeline's); where the
        family's text reads a row's image, each request's own. `size`: the batch's width and
        height (a schedule may depend on it: FLUX.1's shift)."""
        prompts: dict[TextKey, int] = {}
        negatives: dict[TextKey, int] = {}
        read: dict[str, Any] = {}  # the image each request's texts are read with
        rows = []
        for r in batch:
            p = r.params
            low_noise = self.adapter.low_noise_scale(p)  # (two experts: the second's scale)
            base = p.seed if p.seed is not None else random.randrange(2**31)
            steps, guidance = self._defaults(r, settings)
            schedule, source = self._schedule(r, steps, settings, size)
            image = settings.image(r, size)
            owner = None  # (a text of its own: Qwen2.5-VL reads the upload with the prompt)
            if image is not None and self.adapter.text_reads_image:
                owner, read[r.request_id] = r.request_id, image
            for i in range(settings.rows_per_request(r)):
                gen = torch.Generator(device=self.device).manual_seed(base + i)
                negative = None
                if guidance > self.adapter.cfg_above and not self.distilled:
                    negative = negatives.setdefault((p.negative_prompt, owner), len(negatives))
                state = rs.Row(schedule, generator=gen)
                prompt = prompts.setdefault((settings.prompt(r), owner), len(prompts))
                own = None if source is None else dataclasses.replace(source)  # (a row's)
                row = LoopRow(r, base + i, guidance, state, prompt, negative, low_noise, own)
                row.image = image
                row.cache = self._row_cache(p.cache_threshold, negative is not None)
                rows.append(row)
        text = self._embed(list(prompts), read)
        if negatives:
            for row in rows:  # (the negatives' rows follow the prompts')
                row.negative = None if row.negative is None else row.negative + len(prompts)
            text = cat_rows(text, self._embed(list(negatives), read))
        return rows, text

    def _row_cache(self, threshold: float | None, cfg: bool) -> RowCache | None:
        """A new row's cache (empty) at its request's threshold, or the stage's."""
        if self.cache is None:
            return None
        return RowCache(self.cache_threshold if threshold is None else threshold, 1 + cfg)

    def _defaults(self, request: StageRequest, settings: Settings) -> tuple[int, float]:
        """A request's steps and guidance: its own, else its LoRA adapters', else the stage's."""
        p, steps, guidance = request.params, None, None
        if self.loras is not None and p.loras:
            steps, guidance = self.loras.defaults(p.loras)
        steps = p.num_inference_steps or steps or settings.steps
        guidance = _or(p.guidance_scale, _or(guidance, settings.guidance))
        return steps, guidance

    def _schedule(
        self, request: StageRequest, steps: int, settings: Settings, size: tuple[int, int]
    ) -> tuple[rs.Schedule, Source | None]:
        """A request's schedule of `steps`, and its upload where it is an edit that starts from
        it (it runs its strength's last steps)."""
        p, start = request.params, 0
        source = settings.source(request, size)
        if source is not None:
            source.strength = DEFAULT_STRENGTH if p.strength is None else p.strength
            steps, start = self.adapter.edit_steps(steps, source.strength)
        scheduler = self.adapter.scheduler(p.scheduler)
        args = self.adapter.schedule_args(scheduler, steps, *size)
        return rs.schedule_for(scheduler, steps, args, start), source

    def _embed(self, keys: list[TextKey], read: dict[str, Any]) -> Text:
        """The texts of `keys`, each read with its request's image (`read`) where it has one."""
        texts = [text for text, _ in keys]
        if all(owner is None for _, owner in keys):
            return self.embed(texts, None)
        return self.embed(texts, [None if o is None else read[o] for _, o in keys])

    def noise(self, rows: list[LoopRow], shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The rows' first latents: each row's noise from its own generator (an edit row's
        source encoded before, its masked image's draw after, as the pipelines draw), then
        each started as its pipeline starts it (stages/diffusion/edit_rows.py)."""
        edit_rows.encode_sources(self.adapter, rows)
        noise = self.adapter.noise(shape, [r.state.generator for r in rows], self.device, dtype)
        edit_rows.masked_images(self.adapter, rows)
        return edit_rows.first_latents(self.adapter, rows, noise)

    def conditions(
        self, rows: list[LoopRow], latents: torch.Tensor
    ) -> tuple[torch.Tensor, Conditioning | None]:
        """Each row's own conditioning from its image (models/row_conditions.py), rows first,
        made once an image (a request's rows share theirs), and the rows' first `latents` with
        what it fixes put back; (latents, None) where the family's rows carry none."""
        if not self.adapter.conditioned:
            return latents, None
        made: dict[int, Conditioning] = {}
        row = (1, *latents.shape[1:])
        for r in rows:
            if id(r.image) not in made:
                made[id(r.image)] = self.adapter.condition(r.image, row, latents.dtype, self.device)
        each = [made[id(r.image)] for r in rows]
        conditioning = {k: torch.cat([c[k] for c in each]) for k in each[0]}
        for r in rows:
            r.image = None  # (its conditioning is made)
        return self.adapter.put_back(latents, conditioning), conditioning

    # ---- the loop ------------------------------------------------------------------------------
    def step(self, plan: Plan, latents: torch.Tensor) -> torch.Tensor:
        """One step of the rows of `plan` (their `latents`): the guided prediction, then each
        row's scheduler update. Advances the rows' schedule positions."""
        output = self._predict(plan, latents)
        states = [r.state for r in plan.group]
        stepped = rs.step(states, output, latents)
        if plan.anchor is not None:
            stepped = edit_rows.blend(states, plan.anchor, stepped)  # (inpainting rows)
        if plan.put_back is not None:  # (rows from an image)
            stepped = self.adapter.put_back(stepped, plan.put_back)
        return stepped

    def plan(
        self,
        rows: list[LoopRow],
        active: list[int],
        embeds: Text,
        latents: torch.Tensor,
        conditioning: Conditioning | None = None,
    ) -> Plan:
        """What the steps over the rows `active` reuse: their indices, which have guidance,
        the text of their model rows (and their own conditioning, of the set's rows)."""
        group = [rows[i] for i in active]
        cfg = [j for j, r in enumerate(group) if r.cfg]
        text = [r.text for r in group]
        negative = [n for j in cfg if (n := group[j].negative) is not None]
        every_cfg = len(cfg) == len(group)
        device = latents.device
        negatives = None
        if cfg and self.batched_cfg:
            texts = take(embeds, text + negative, device)
        else:
            texts = take(embeds, text, device)
            negatives = take(embeds, negative, device) if cfg else None
        scales = [group[j].guidance for j in cfg]
        scale: float | torch.Tensor = 1.0
        if every_cfg and len(set(scales)) == 1:  # one scale: as the pipeline applies it
            scale = scales[0]
        elif cfg:
            scale = column(scales, latents)
        embedded = None
        if self.distilled:
            embedded = to_device(torch.tensor([r.guidance for r in group]), device)
        pairs = [(group[j].guidance, _or(group[j].guidance_2, group[j].guidance)) for j in cfg]
        by_expert = pairs if any(a != b for a, b in pairs) else None
        plan = Plan(
            active=active,
            group=group,
            index=None if len(active) == len(rows) else row_index(active, device),
            cfg=cfg,
            cfg_index=None if every_cfg or not cfg else row_index(cfg, device),
            texts=texts,
            negatives=negatives,
            scale=scale,
            embedded=embedded,
            by_expert=by_expert,
            anchor=edit_rows.anchors_of(group, latents),
        )
        self._plan_conditioning(plan, conditioning, device)
        return self._plan_loras(plan, device)

    def _plan_loras(self, plan: Plan, device: torch.device) -> Plan:
        """The model rows' LoRA adapters: the unconditional branch takes its row's."""
        if (pool := self.loras) is None:
            return plan
        uncond = [plan.group[j].lora for j in plan.cfg]
        both = bool(plan.cfg) and self.batched_cfg
        plan.lora = pool.rows([r.lora for r in plan.group] + (uncond if both else []), device)
        plan.negative_lora = pool.rows(uncond, device) if plan.cfg and not both else None
        return plan

    def _plan_conditioning(
        self, plan: Plan, conditioning: Conditioning | None, device: torch.device
    ) -> None:
        """The plan's rows' own conditioning (of the set's `conditioning`; a mask-taking
        denoiser's inpainting rows: their mask inputs), and their model rows': the
        unconditional branch takes its row's as the conditional one does."""
        if conditioning is not None:
            own = (
                conditioning
                if plan.index is None
                else take_named(conditioning, plan.active, device)
            )
        elif (first := plan.group[0].mask_input) is not None:  # (an inpainting set's rows)
            inputs = [c for r in plan.group if (c := r.mask_input) is not None]
            own = {k: torch.cat([c[k] for c in inputs]) for k in first}
        else:
            return
        plan.put_back = own
        uncond = own if plan.cfg_index is None else take_named(own, plan.cfg, device)
        if plan.cfg and self.batched_cfg:
            plan.conditioning = cat_named(own, uncond)
        else:
            plan.conditioning = own
            plan.negative_conditioning = uncond if plan.cfg else None

    def _predict(self, plan: Plan, latents: torch.Tensor) -> torch.Tensor:
        """The guided prediction of each row: the conditional branch of all, the unconditional
        of those with guidance, in one forward (two with `batched_cfg` off)."""
        states = [r.state for r in plan.group]
        scaled = rs.scale_input(states, latents)
        cfg, index = plan.cfg, plan.cfg_index
        uncond_rows = scaled if index is None else scaled[index]
        if cfg and self.batched_cfg:
            inputs = torch.cat([scaled, uncond_rows])
            both = states + [states[j] for j in cfg]
            slots = plan.cache_slots() + plan.cache_slots(1)
            out = self._forward(inputs, both, plan.texts, None, plan.conditioning, plan.lora, slots)
            cond, uncond = out[: len(states)], out[len(states) :]
        else:
            cond, uncond = self._two_forwards(plan, scaled, uncond_rows)
            if uncond is None:
                return cond
        scale = plan.scale if plan.by_expert is None else self._expert_scale(plan, cond)
        if index is None:  # every row has guidance
            return self.adapter.guide(cond, uncond, scale)
        out = cond.clone()
        out[index] = self.adapter.guide(cond[index], uncond, scale)
        return out

    def _two_forwards(
        self, plan: Plan, scaled: torch.Tensor, uncond_rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The conditional forward of every row and the unconditional one of the rows with
        guidance (None: no row has), one after the other; CFG-parallel (`branches`): the
        unconditional one on rank 1 meanwhile, its inputs padded here as a forward pads them."""
        states, cfg_states = [r.state for r in plan.group], [plan.group[j].state for j in plan.cfg]
        slots = plan.cache_slots()
        cond = (scaled, states, plan.texts, plan.embedded, plan.conditioning, plan.lora, slots)
        if not plan.cfg:
            return self._forward(*cond), None
        assert plan.negatives is not None  # (a plan with guidance, two forwards)
        uncond = (uncond_rows, cfg_states, plan.negatives, None, plan.negative_conditioning)
        if self.branches is None:
            negative = (plan.negative_lora, plan.cache_slots(1))
            return self._forward(*cond), self._forward(*uncond, *negative)
        inputs, at, _ = self._padded(*uncond, plan.negative_lora)  # (its rows: rank 1 sets them)
        mine, theirs = self.branches.alongside(lambda: self._forward(*cond), inputs, at)
        return mine, theirs[: len(cfg_states)]

    def _expert_scale(self, plan: Plan, like: torch.Tensor) -> float | torch.Tensor:
        """This step's scale of each guided row: its low-noise one where its timestep runs the
        second expert (as WanPipeline switches `guidance_scale_2` in with `transformer_2`)."""
        assert plan.by_expert is not None and self.host_times
        times = [float(plan.group[j].state.timestep) for j in plan.cfg]  # (host timesteps)
        scales = [
            pair[self.adapter.expert_for(t)] for pair, t in zip(plan.by_expert, times, strict=True)
        ]
        if len(set(scales)) == 1 and len(plan.cfg) == len(plan.group):
            return scales[0]
        return column(scales, like)

    def _forward(
        self,
        latents: torch.Tensor,
        states: list[rs.Row],
        text: Text,
        guidance: torch.Tensor | None = None,
        conditioning: Conditioning | None = None,
        lora: LoraRows | None = None,
        slots: list[tuple[RowCache | None, int]] | None = None,
    ) -> Any:
        """One denoiser call (each model row at its row's timestep; `guidance`: each row's
        scale, for a guidance embedding; `conditioning`: each model row's own, where rows carry
        one; `lora`: each model row's adapters; `slots`: each model row's step cache and
        branch), padded to the compiled bucket of its rows."""
        rows = latents.shape[0]
        inputs, at, pad = self._padded(latents, states, text, guidance, conditioning, lora)
        call = lambda given: self.run_denoiser(given, at)  # noqa: E731
        with cache_pass(self.cache, slots, pad):
            return self.graphs.forward(inputs, call, replayable=at is None)[:rows]

    def _padded(
        self,
        latents: torch.Tensor,
        states: list[rs.Row],
        text: Text,
        guidance: torch.Tensor | None,
        conditioning: Conditioning | None,
        lora: LoraRows | None = None,
    ) -> tuple[Inputs, list[float] | None, int]:
        """A forward's inputs padded to the compiled bucket of its rows (`lora`: its rows'
        adapters, static inputs of a graph: copied in each step like the rest), its host
        timesteps (two experts) and the rows of padding."""
        rows = latents.shape[0]
        times = rs.timesteps(states, latents.device)
        if self.buckets:  # a compiled graph guards the layout: rows that share a timestep (a
            times = times.contiguous()  # view of stride 0) would compile a second one
        pad = bucket_for(rows, self.buckets) - rows
        if pad:
            padded = pad_each(pad, latents, times, text, guidance, conditioning)
            latents, times, text, guidance, conditioning = padded
            states = states + [states[-1]] * pad
        at = [float(s.timestep) for s in states] if self.host_times else None
        inputs: Inputs = {"latents": latents, "times": times, "text": text}
        if lora is not None:
            index, scale = pad_each(pad, *lora) if pad else lora
            inputs["lora"] = {"index": index, "scale": scale}
        return inputs | {"guidance": guidance, "conditioning": conditioning}, at, pad

    def run_denoiser(self, inputs: Inputs, at: list[float] | None) -> Any:
        """The adapter's denoiser call on `inputs` (`at`: host timesteps, two experts), its
        LoRA layers reading the rows' adapters from them (a graph's capture: its buffers); a
        CFG-parallel rank 1 runs rank 0's unconditional forwards so."""
        latents, times, text = inputs["latents"], inputs["times"], inputs["text"]
        lora = inputs.get("lora")
        rows = None if lora is None else (lora["index"], lora["scale"])
        with nullcontext() if self.loras is None else self.loras.context.rows(rows):
            if (conditioning := inputs["conditioning"]) is not None:
                return self.adapter.predict_conditioned(latents, times, text, conditioning, at)
            return self.adapter.predict(latents, times, text, at=at, guidance=inputs["guidance"])


def _or(value: float | None, default: float) -> float:
    return default if value is None else value
