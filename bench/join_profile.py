"""Where a row's join spends its host time (#54): a request's text encoders, tokenizers,
schedule, noise and conditioning, timed part by part on a loaded stage, with the device syncs
the join makes (ops that read the device back: `aten::_local_scalar_dense` - `.item()`,
`.tolist()` - and `aten::nonzero` - a boolean mask's indexing).

    python bench/join_profile.py --model tiny-image              # SD1.5-like, eager encoders
    python bench/join_profile.py --model sdxl --compiled          # + text encoders compiled
    python bench/join_profile.py --model z-image --device cuda    # a GPU's (median of --runs)

`--model`: tiny-image, or a tiny test model (sdxl, flux, sd3, z-image: built as the tests build
them), or a model directory (`--load-format dummy`: an architecture's, random weights, e.g.
vllm_omni_like/assets/archs/sdxl). `--compiled`: the stage's text encoders compiled as
`--compile-text-encoders on` compiles them (inductor; one text a call), warmed up with one
text first. Prints one JSON line: the first join's ms (compiled: the encoders' compile), each
part's median ms a join (nested: `encode_text` holds the tokenizers, encoders and diffusers'
lookups; "rest": the join less its top parts, the rows' bookkeeping), and its syncs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vllm_omni_like.config import StageConfig
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.diffusion import acceleration as accel
from vllm_omni_like.stages.diffusion.running_set import OwnLoopSet
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.wire import StageRequest

SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero")
TOP_PARTS = ("encode_text", "_schedule", "noise", "conditions")  # (the join's, not nested)
PROMPT = "a photo of a red fox in the snow, golden hour, detailed fur"


def model_path(name: str) -> str:
    """A tiny test model by name (built on first use), or `name` itself."""
    if name in ("sdxl", "flux", "sd3", "z-image"):
        from tests.models.tiny_mmdit import tiny_flux_path, tiny_sd3_path
        from tests.models.tiny_sdxl import tiny_sdxl_path
        from tests.models.tiny_z_image import tiny_z_image_path

        paths = {"sdxl": tiny_sdxl_path, "flux": tiny_flux_path, "sd3": tiny_sd3_path}
        return {**paths, "z-image": tiny_z_image_path}[name]()
    return name


class Timer:
    """Each wrapped part's seconds, summed over one join (`parts`), kept per join (`joins`)."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self.joins: list[dict[str, float]] = []

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.parts[name] = self.parts.get(name, 0.0) + time.perf_counter() - t0

        return timed

    def medians(self) -> dict[str, float]:
        names = {k for j in self.joins for k in j}
        return {
            k: round(statistics.median(j.get(k, 0.0) for j in self.joins) * 1e3, 3)
            for k in sorted(names)
        }


def instrument(stage: DiffusionStage, timer: Timer) -> None:
    """Wrap the join's parts: tokenizers (their class's `__call__`), each text encoder's
    forward, the adapter's encode, diffusers' execution-device lookups and textual-inversion
    pass, the loop's schedule, noise and conditioning."""
    rt = stage.runtime
    pipe, loop = rt.pipe, rt.denoise
    for name in ("tokenizer", "tokenizer_2", "tokenizer_3"):
        tok = getattr(pipe, name, None)
        if tok is not None:
            cls = type(tok)
            tok.__class__ = type(cls.__name__, (cls,), {"__call__": timer.wrap(name, cls.__call__)})
    for owner, name in rt.adapter.text_encoder_targets():
        module = getattr(owner, name)
        module.forward = timer.wrap(name, module.forward)
    rt.adapter.encode_text = timer.wrap("encode_text", rt.adapter.encode_text)  # type: ignore[method-assign]  # (timing only)
    for base in type(pipe).__mro__:  # diffusers' lookups: the encoders' execution device
        module: Any = sys.modules.get(base.__module__)
        lookup = getattr(module, "get_module_execution_device", None)
        if lookup is not None and not hasattr(lookup, "__wrapped__"):
            module.get_module_execution_device = timer.wrap("device lookups", lookup)
    if hasattr(pipe, "maybe_convert_prompt"):  # (and the textual-inversion pass)
        pipe.maybe_convert_prompt = timer.wrap("textual inversion", pipe.maybe_convert_prompt)
    for name in ("_schedule", "noise", "conditions"):
        setattr(loop, name, timer.wrap(name, getattr(loop, name)))


def join_once(stage: DiffusionStage, request: StageRequest) -> None:
    """One request's join into a running set that nothing else is in, as the worker joins."""
    rowset = OwnLoopSet(stage.runtime)
    rowset.join([request], StageControl(FaultInjector((), "diffusion")))
    rowset.set.let_go()


def syncs(stage: DiffusionStage, request: StageRequest) -> dict[str, int]:
    """The device syncs one join makes (ops that read the device back)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        join_once(stage, request)
    counts = {e.key: e.count for e in prof.key_averages() if e.key in SYNC_OPS}
    return {op: counts.get(op, 0) for op in SYNC_OPS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-image")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--load-format", default="auto", help="dummy: random weights")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--compiled", action="store_true")
    ap.add_argument("--guidance", type=float, help="the request's (default: the stage's)")
    # one thread by default: on a shared CPU, OpenMP's threads wait on each other's cores and
    # a tiny matmul's time swings by 100x (a tiny CLIP's join 7 to 260 ms from run to run)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    config = StageConfig(
        name="diffusion",
        kind="diffusion",
        model=model_path(args.model),
        dtype=args.dtype,
        load_format=args.load_format,
    )
    stage = DiffusionStage(config)
    stage.load(args.device)
    rt = stage.runtime
    if args.compiled:
        accel.compile_text_encoders(rt.adapter, "default", "inductor")
        rt.denoise.embed = dataclasses.replace(rt.text, one_text_a_call=True)
    params = GenerationParams(seed=0, num_inference_steps=4, guidance_scale=args.guidance)
    request = StageRequest("r", PROMPT, params)
    timer = Timer()
    instrument(stage, timer)
    sync = torch.cuda.synchronize if rt.device.type == "cuda" else (lambda: None)
    for run in range(args.runs + 2):  # (the first two: warm-up, a compile where compiled)
        timer.parts = {}
        t0 = time.perf_counter()
        join_once(stage, request)
        timer.parts["join (host)"] = time.perf_counter() - t0
        sync()
        timer.parts["join (synced)"] = time.perf_counter() - t0
        inner = sum(timer.parts.get(k, 0.0) for k in TOP_PARTS)
        timer.parts["rest (rows' bookkeeping)"] = timer.parts["join (host)"] - inner
        if run >= 2:
            timer.joins.append(timer.parts)
        elif run == 0:  # (compiled: the encoders' compile, the start-up cost it adds)
            first_ms = round(timer.parts["join (synced)"] * 1e3, 1)
    result = {"model": args.model, "device": args.device, "threads": args.threads}
    result["compiled_text_encoders"] = args.compiled
    result |= {"first_join_ms": first_ms, "ms": timer.medians()}
    result["syncs_per_join"] = syncs(stage, request)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
