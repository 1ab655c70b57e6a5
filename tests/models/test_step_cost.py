"""A guard on the CPU for what a GPU would show as a slow step: for each family's tiny model, the
server's compiled step (its warmed-up buckets) does no more denoiser FLOPs than the diffusers
pipeline's step at the same rows (<= 1.02x, rows with and without guidance), compiles without a
graph break, and never waits on the device inside a step (`.item()`, `.tolist()`, `.cpu()`,
`bool(tensor)`, `float(tensor)` counted while a step runs; tests/gpu/test_step_sync_gpu.py runs
a compiled step under CUDA's sync debug mode).

Prompts (and negative prompts) fill a text bucket exactly, so the texts the server pads to its
buckets are as long as the pipeline's own: what is left to differ is the rows a forward runs."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tests.models.test_family_contract import TINY, Case, case_of
from vllm_omni_like.models.adapter import Adapter, Guidance, adapter_for
from vllm_omni_like.models.registry import family_of
from vllm_omni_like.models.text_buckets import TEXT_BUCKETS, WORD
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.diffusion.acceleration import guided_rows
from vllm_omni_like.stages.diffusion.step import DenoiseLoop
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.wire import Mode, StageRequest

pytestmark = pytest.mark.slow
STEPS = 2
# the families whose step once ran padded rows (Z-Image-Turbo at guidance 0; SD at scale 1) run
# by default; the others as a drill (each compiles its buckets: tens of seconds a family)
DEFAULT = ("stable-diffusion", "z-image")
FAMILIES = [
    pytest.param(name, marks=() if name in DEFAULT else pytest.mark.drill)
    for name in sorted(TINY)
    if name not in ("qwen-image-edit", "wan-i2v")  # (their requests carry an image: not here)
]
# the Tensor methods that wait for the device; counted on floating-point tensors (latents,
# timesteps, scales, embeddings: what a step keeps on the device), not on the integer
# bookkeeping built on the host by design (row indices, Z-Image's token counts), which on a CPU
# looks the same
SYNCS = ("item", "tolist", "cpu", "__bool__", "__float__")


@pytest.fixture(scope="module", params=FAMILIES)
def case(request) -> Case:
    return case_of(request.param)


@pytest.fixture(scope="module")
def served(case: Case):
    """The family's stage compiled (dynamo with the eager backend: real tracing and guards, no C
    compiler) for one image a forward, warmed up."""
    from torch._dynamo.utils import counters

    counters.clear()
    stage = case.stage(
        compile=True,
        max_batch_size=1,
        batch_buckets=(1,),
        options={**case.options, "compile_backend": "eager"},
    )
    return stage, dict(counters["graph_break"])


def _filling_prompt(stage) -> str:
    """A prompt of exactly the first text bucket's tokens for a family that pads texts to
    buckets (counted as its warm-up counts them), else a plain one."""
    adapter = stage.runtime.adapter
    if type(adapter).warm_up_prompts is Adapter.warm_up_prompts:
        return "a red circle"
    with torch.inference_mode():
        counts = {}
        for words in range(1, 2 * TEXT_BUCKETS[0]):
            prompt = " ".join([WORD] * words)
            text = adapter.encode_text([prompt], stage.runtime.device, 0)
            counts[words] = int(text["mask"].sum() if "mask" in text else text["lengths"][0])
            if counts[words] == TEXT_BUCKETS[0]:
                return prompt
    raise AssertionError(f"no prompt of {TEXT_BUCKETS[0]} tokens: {counts}")


@contextlib.contextmanager
def _counting(module_or_fn_owner, name: str, flops: list[int]):
    """Counts the FLOPs of every call of `owner.name` into `flops`."""
    inner = getattr(module_or_fn_owner, name)

    def counted(*args, **kwargs):
        with warnings.catch_warnings(), FlopCounterMode(display=False) as counter:
            # (the counter's module hooks are global: torch warns that a compiled module's
            # hooks fire twice, which changes no count of operators)
            warnings.filterwarnings("ignore", "Using `torch.compile", UserWarning)
            out = inner(*args, **kwargs)
        flops.append(counter.get_total_flops())
        return out

    setattr(module_or_fn_owner, name, counted)
    try:
        yield
    finally:
        setattr(module_or_fn_owner, name, inner)


def _reference_flops(case: Case, prompt: str, guidance: float) -> float:
    """The pipeline's denoiser FLOPs a step: its own call, every denoiser forward counted."""
    pipe = case.pipeline()
    adapter = adapter_for(pipe, family_of(case.path))
    flops: list[int] = []
    handles = []
    for expert in adapter.experts():
        model = expert.model
        modes: list[FlopCounterMode] = []
        handles.append(model.register_forward_pre_hook(lambda *_, m=modes: _enter(m)))
        handles.append(model.register_forward_hook(lambda *_, m=modes: _leave(m, flops)))
    limits = case.limits()
    kwargs = dict(
        width=limits.default_width,
        height=limits.default_height,
        num_inference_steps=STEPS,
        generator=[torch.Generator().manual_seed(3)],
        output_type="latent",
        **adapter.text_kwargs([prompt], [prompt], getattr(pipe, "tokenizer", None)),
        **adapter.guidance_kwargs(guidance),
    )
    if case.video:
        kwargs["num_frames"] = 5
    try:
        with torch.inference_mode():
            pipe(**kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return sum(flops) / STEPS


def _enter(modes: list[FlopCounterMode]) -> None:
    modes.append(FlopCounterMode(display=False))
    modes[-1].__enter__()


def _leave(modes: list[FlopCounterMode], flops: list[int]) -> None:
    mode = modes.pop()
    mode.__exit__(None, None, None)
    flops.append(mode.get_total_flops())


def _served_flops(stage, case: Case, prompt: str, guidance: float) -> tuple[float, dict]:
    """The server's denoiser FLOPs a step, and the device waits counted inside its steps."""
    params = GenerationParams(
        seed=3,
        num_inference_steps=STEPS,
        guidance_scale=guidance,
        negative_prompt=prompt,
        num_frames=5 if case.video else None,
    )
    mode = Mode.TEXT2VIDEO if case.video else Mode.TEXT2IMG
    request = StageRequest("r", prompt, params, mode=mode)
    flops: list[int] = []
    syncs = dict.fromkeys(SYNCS, 0)
    with _counting(stage.runtime.adapter, "predict", flops), _syncs_in_steps(syncs):
        (out,) = stage.execute([request], StageControl(FaultInjector((), "diffusion")))
    assert out.error is None, out.error
    return sum(flops) / STEPS, syncs


@contextlib.contextmanager
def _syncs_in_steps(syncs: dict[str, int]):
    """Counts the calls of each waiting Tensor method made while a loop's step runs."""
    inside = [False]
    step = DenoiseLoop.step

    def stepping(self, plan, latents):
        inside[0] = True
        try:
            return step(self, plan, latents)
        finally:
            inside[0] = False

    originals = {name: getattr(torch.Tensor, name) for name in SYNCS}

    def counter(name):
        def call(self, *args, **kwargs):
            if inside[0] and self.is_floating_point():
                syncs[name] += 1
            return originals[name](self, *args, **kwargs)

        return call

    DenoiseLoop.step = stepping
    for name in SYNCS:
        setattr(torch.Tensor, name, counter(name))
    try:
        yield
    finally:
        DenoiseLoop.step = step
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _guidances(stage) -> list[float]:
    """Without guidance (one model row an image) and, where the family has it, with it."""
    plain = stage.runtime.adapter.cfg_above
    if stage.runtime.adapter.guidance in (Guidance.DISTILLED, Guidance.NONE):
        return [stage.runtime.family.default_guidance]
    return [plain, max(stage.runtime.family.default_guidance, plain + 1.0)]


def test_a_served_step_costs_what_the_pipelines_step_costs(case, served):
    stage, breaks = served
    assert breaks == {}, f"graph breaks in the compiled denoiser: {breaks}"
    prompt = _filling_prompt(stage)
    for guidance in _guidances(stage):
        got, syncs = _served_flops(stage, case, prompt, guidance)
        want = _reference_flops(case, prompt, guidance)
        assert want > 0
        assert got <= 1.02 * want, (case.name, guidance, got / want)
        assert syncs == dict.fromkeys(SYNCS, 0), (case.name, guidance, syncs)


def test_the_model_row_buckets_hold_rows_with_and_without_guidance(served):
    stage, _ = served
    buckets = stage.runtime.denoise.buckets
    assert 1 in buckets  # a row without guidance: one model row, not padded to two
    assert guided_rows(stage.runtime.adapter, stage.config.batched_cfg) in buckets
