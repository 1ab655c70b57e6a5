"""One denoising step of rows with their own steps, scheduler, guidance scale and seed.

Our own denoising loop: every row with its own steps, scheduler and its state, guidance scale
(CFG on or off) and seed, stepped together.

A batch's text is encoded once on entry (each distinct prompt and negative prompt once); each
row's noise comes from its own generator. Each step runs one forward over every live row's
conditional branch and the unconditional branch of the rows with guidance (model rows: two per
CFG row, one otherwise; a compiled denoiser pads them to its warmed-up bucket), combines each
CFG row with its own scale, and steps every row with its own scheduler (models/row_schedulers.py:
one vectorised update a kind, no `step()` per row). A row that ends its steps, or whose request
is aborted, leaves the forward; the loop ends when none is left. What a row computes depends on
its own inputs only, so it equals that row run alone (a batched matmul may round differently:
tests/stages/diffusion/test_step.py bounds it). The latents go to the stage's deferred decode.

What differs between families is the adapter's (models/adapter.py): `encode_text`, `noise`,
`latent_dtype`, `predict`, `guide`, `scheduler`.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni_like.models import row_schedulers as rs
from vllm_omni_like.models.adapter import Adapter, Guidance, pad_tokens
from vllm_omni_like.models.columns import column, to_device
from vllm_omni_like.params import DEFAULT_STRENGTH
from vllm_omni_like.stages.diffusion import edit_rows
from vllm_omni_like.stages.diffusion.acceleration import bucket_for
from vllm_omni_like.stages.diffusion.edit_rows import Anchor, Source
from vllm_omni_like.wire import StageRequest

# a batch's text conditioning: embeddings (rows, seq, dim), or named tensors with rows first
# (SDXL's embeddings and pooled embeddings; a "mask" where texts keep their own lengths)
Text = torch.Tensor | dict[str, torch.Tensor]
# texts -> their conditioning on the device; None: a negative prompt not given (SDXL: zeros)
Embed = Callable[[list[str | None]], Text]


def take(text: Text, rows: list[int], device: torch.device) -> Text:
    """The text rows `rows` (a value kept on the host - Z-Image's token counts - picked there:
    nothing waits for the device)."""
    index = row_index(rows, device)
    if isinstance(text, dict):
        host = torch.tensor(rows, dtype=torch.long)
        return {k: v[index] if v.device == index.device else v[host] for k, v in text.items()}
    return text[index]


def pad_tensor(value: torch.Tensor, pad: int) -> torch.Tensor:
    """`pad` more rows, copies of the last."""
    return torch.cat([value, value[-1:].expand(pad, *value.shape[1:])])


def pad_rows(value: Text, pad: int) -> Text:
    if isinstance(value, dict):
        return {k: pad_tensor(v, pad) for k, v in value.items()}
    return pad_tensor(value, pad)


def cat_rows(a: Text, b: Text) -> Text:
    if isinstance(a, dict) and isinstance(b, dict):
        if "mask" in a:  # texts of their own lengths: both padded to the longer, masked
            length = max(a["mask"].shape[1], b["mask"].shape[1])
            a, b = pad_tokens(a, length), pad_tokens(b, length)
        return {k: torch.cat([a[k], b[k]]) for k in a}
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.cat([a, b])
    raise TypeError("text conditionings of two kinds")


def text_dtype(text: Text) -> torch.dtype:
    return next(iter(text.values())).dtype if isinstance(text, dict) else text.dtype


@dataclass
class LoopRow:
    request: StageRequest
    seed: int
    guidance: float
    state: rs.Row
    text: int  # its prompt's row of the batch's embeddings
    negative: int | None  # its negative prompt's (a row with guidance), else None
    guidance_2: float | None = None  # the low-noise expert's scale (two experts), else None
    # an edit row's upload until its latents are made (`noise`), else None
    source: Source | None = None
    anchor: Anchor | None = None  # an inpainting row's: what each step puts back

    @property
    def cfg(self) -> bool:
        return self.negative is not None


@dataclass
class Plan:
    """A step's reusables for one set of active rows (made again when the set changes)."""

    active: list[int]
    group: list[LoopRow]
    index: torch.Tensor | None  # the active rows among the batch's (None: all)
    cfg: list[int]  # the positions among them with guidance
    cfg_index: torch.Tensor | None  # those on the device (None: all, or none)
    texts: Text  # the model rows' text (with batched CFG: both branches')
    negatives: Text | None  # two forwards: the unconditional branch's
    scale: float | torch.Tensor  # one guidance scale, or a column of them (1: no guidance)
    embedded: torch.Tensor | None = None  # a DISTILLED family's: each row's scale (float32)
    # two experts: each guided row's (scale, the low-noise expert's), where one differs
    by_expert: list[tuple[float, float]] | None = None
    anchor: Anchor | None = None  # inpainting rows': what each step puts back (others: none)


@dataclass(frozen=True)
class Settings:
    """What a request leaves unsaid: the stage's defaults."""

    steps: int
    guidance: float
    rows_per_request: Callable[[StageRequest], int]
    prompt: Callable[[StageRequest], str] = lambda request: request.prompt  # (truncated)
    # an edit's upload (and mask) at the batch's (width, height); None: a row from noise
    source: Callable[[StageRequest, tuple[int, int]], Source | None] = lambda r, s: None


class DenoiseLoop:
    def __init__(
        self,
        adapter: Adapter,
        device: torch.device,
        embed: Embed,
        buckets: tuple[int, ...] = (),
        batched_cfg: bool = True,
    ) -> None:
        self.adapter = adapter
        self.device = device
        self.embed = embed
        self.buckets = buckets  # model rows a compiled denoiser was warmed up for
        self.batched_cfg = batched_cfg  # False: the two branches in two forwards
        # host timesteps for the adapter only where it chooses an expert by them (Wan2.2)
        experts = adapter.experts()
        self.host_times = len(experts) > 1
        self.boundary = experts[0].boundary  # (two experts: the low-noise one's below it)
        # a guidance embedding (FLUX.1): each row's scale goes into its one forward, no CFG
        self.distilled = adapter.guidance is Guidance.DISTILLED

    # ---- entry --------------------------------------------------------------------------------
    def rows(
        self, batch: list[StageRequest], settings: Settings, size: tuple[int, int] = (0, 0)
    ) -> tuple[list[LoopRow], Any]:
        """Each request's rows (`n` images, or one video), and the batch's text conditioning:
        each distinct prompt once, then each distinct negative prompt once, in two encoder
        calls as a pipeline makes them (a batch's rounding then is the pipeline's). `size`:
        the batch's width and height (a schedule may depend on it: FLUX.1's shift)."""
        prompts: dict[str | None, int] = {}
        negatives: dict[str | None, int] = {}

        rows = []
        for r in batch:
            p = r.params
            low_noise = self.adapter.low_noise_scale(p)  # (two experts: the second's scale)
            base = p.seed if p.seed is not None else random.randrange(2**31)
            guidance = settings.guidance if p.guidance_scale is None else p.guidance_scale
            steps, start = p.num_inference_steps or settings.steps, 0
            source = settings.source(r, size)
            if source is not None:  # (an edit row runs its strength's last steps)
                source.strength = DEFAULT_STRENGTH if p.strength is None else p.strength
                steps, start = self.adapter.edit_steps(steps, source.strength)
            scheduler = self.adapter.scheduler(p.scheduler)
            args = self.adapter.schedule_args(scheduler, steps, *size)
            schedule = rs.schedule_for(scheduler, steps, args, start)
            for i in range(settings.rows_per_request(r)):
                gen = torch.Generator(device=self.device).manual_seed(base + i)
                negative = None
                if guidance > self.adapter.cfg_above and not self.distilled:
                    negative = negatives.setdefault(p.negative_prompt, len(negatives))
                state = rs.Row(schedule, generator=gen)
                prompt = prompts.setdefault(settings.prompt(r), len(prompts))
                own = None if source is None else dataclasses.replace(source)  # (a row's)
                row = LoopRow(r, base + i, guidance, state, prompt, negative, low_noise, own)
                rows.append(row)
        text = self.embed(list(prompts))
        if negatives:
            for row in rows:  # (the negatives' rows follow the prompts')
                row.negative = None if row.negative is None else row.negative + len(prompts)
            text = cat_rows(text, self.embed(list(negatives)))
        return rows, text

    def noise(self, rows: list[LoopRow], shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The rows' first latents: each row's noise from its own generator (an edit row's
        source encoded before, its masked image's draw after, as the pipelines draw), then
        each started as its pipeline starts it (stages/diffusion/edit_rows.py)."""
        edit_rows.encode_sources(self.adapter, rows)
        noise = self.adapter.noise(shape, [r.state.generator for r in rows], self.device, dtype)
        edit_rows.masked_image_draws(rows)
        return edit_rows.first_latents(self.adapter, rows, noise)

    # ---- the loop ------------------------------------------------------------------------------
    def step(self, plan: Plan, latents: torch.Tensor) -> torch.Tensor:
        """One step of the rows of `plan` (their `latents`): the guided prediction, then each
        row's scheduler update. Advances the rows' schedule positions."""
        output = self._predict(plan, latents)
        states = [r.state for r in plan.group]
        stepped = rs.step(states, output, latents)
        if plan.anchor is None:
            return stepped
        return edit_rows.blend(states, plan.anchor, stepped)  # (inpainting rows)

    def plan(
        self, rows: list[LoopRow], active: list[int], embeds: Text, latents: torch.Tensor
    ) -> Plan:
        """What the steps over the rows `active` reuse: their indices, which have guidance,
        the text of their model rows."""
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
        return Plan(
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

    def _predict(self, plan: Plan, latents: torch.Tensor) -> torch.Tensor:
        """The guided prediction of each row: the conditional branch of all, the unconditional
        of those with guidance, in one forward (two with `batched_cfg` off)."""
        states = [r.state for r in plan.group]
        scaled = rs.scale_input(states, latents)
        cfg, index = plan.cfg, plan.cfg_index
        uncond_rows = scaled if index is None else scaled[index]
        cfg_states = [states[j] for j in cfg]
        if cfg and self.batched_cfg:
            inputs = torch.cat([scaled, uncond_rows])
            out = self._forward(inputs, states + cfg_states, plan.texts)
            cond, uncond = out[: len(states)], out[len(states) :]
        else:
            cond = self._forward(scaled, states, plan.texts, plan.embedded)
            if not cfg:
                return cond
            assert plan.negatives is not None  # (a plan with guidance, two forwards)
            uncond = self._forward(uncond_rows, cfg_states, plan.negatives)
        scale = plan.scale if plan.by_expert is None else self._expert_scale(plan, cond)
        if index is None:  # every row has guidance
            return self.adapter.guide(cond, uncond, scale)
        out = cond.clone()
        out[index] = self.adapter.guide(cond[index], uncond, scale)
        return out

    def _expert_scale(self, plan: Plan, like: torch.Tensor) -> float | torch.Tensor:
        """This step's scale of each guided row: its low-noise one where its timestep is under
        the boundary (as WanPipeline switches `guidance_scale_2` in with `transformer_2`)."""
        assert plan.by_expert is not None and self.boundary is not None
        times = [float(plan.group[j].state.timestep) for j in plan.cfg]  # (host timesteps)
        scales = [
            low if t < self.boundary else high
            for (high, low), t in zip(plan.by_expert, times, strict=True)
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
    ) -> Any:
        """One denoiser call (each model row at its row's timestep; `guidance`: each row's
        scale, for a guidance embedding), padded to the compiled bucket of its model rows."""
        rows = latents.shape[0]
        times = rs.timesteps(states, latents.device)
        if self.buckets:  # a compiled graph guards the layout: rows that share a timestep (a
            times = times.contiguous()  # view of stride 0) would compile a second one
        pad = bucket_for(rows, self.buckets) - rows
        if pad:
            latents, times = pad_tensor(latents, pad), pad_tensor(times, pad)
            text = pad_rows(text, pad)
            states = states + [states[-1]] * pad
            guidance = None if guidance is None else pad_tensor(guidance, pad)
        at = [float(s.timestep) for s in states] if self.host_times else None
        return self.adapter.predict(latents, times, text, at=at, guidance=guidance)[:rows]


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def row_index(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row positions as an index tensor on `device` (a pinned, non-blocking copy)."""
    return to_device(torch.tensor(rows, dtype=torch.long), device)
