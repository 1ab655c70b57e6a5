"""One denoising forward, the server's against the reference's: where a step's time goes (#38).

    python bench/forward_probe.py --model z-image-turbo               # one GPU call (~3 min)
    python bench/forward_probe.py --model /tmp/tiny-z --dtype fp32    # a CPU smoke run

bench/models.py times whole requests; this times the one call a step is made of, on the same
model (random weights, `--load-format dummy`'s seeded recipe) at the same size, one row:
- reference: the pipeline's own denoiser call, its arguments captured from the pipeline's first
  step as diffusers passes them, replayed on the transformer compiled whole as bench/models.py
  compiles it (fused QKV where diffusers has it, `fullgraph=True, dynamic=False`);
- server: the adapter's `predict` (what the server's loop calls each step) on a second copy of
  the pipeline after the stage's own speed-ups (its attention, `tune_kernels`, `compile_models`
  over the adapter's `compile_targets`).
Each side: the forward's device time (median of `--runs`; CUDA events), the host's time to
launch it from an empty queue (as long as the device's: host-bound), the host-device waits
inside one forward (CUDA's sync debug mode, by where) and its top kernels by device time
(torch.profiler; on the CPU, its top operators). Writes `<out-dir>/forward_probe-<device>.json`
(`models.<name>.reference` / `.server`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.cli_flags import add_compile_mode, add_dtype, add_model, add_outputs, parser
from bench.models import PROMPT, SETTINGS, build, call_kwargs
from bench.raw_diffusers import DTYPES, device_name, free, sync
from vllm_omni_like.models.registry import family_of
from vllm_omni_like.pipelines.catalog import ARCH_OPTIONS, arch_path

TOP = 12  # kernels (operators on the CPU) kept per side
OURS = re.compile(r"vllm_omni_like/|diffusers/|bench/")  # frames a wait is traced back to


class Captured(Exception):
    """Raised by the capture hook: the pipeline's first denoiser call is all that is needed."""


def launch_and_device_ms(fn: Callable[[], Any], runs: int) -> tuple[list[float], float]:
    """`fn`'s device times (ms, after two warm-ups; the host's clock off CUDA) and the host's
    median time to return from it, started on an empty queue."""
    cuda = torch.cuda.is_available()
    times, host = [], []
    for i in range(2 + runs):
        sync()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fn()
        launched = 1000 * (time.perf_counter() - t0)
        if cuda:
            end.record()
            end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) if cuda else launched)
            host.append(launched)
    return times, statistics.median(host)


def waits(fn: Callable[[], Any]) -> dict[str, int]:
    """The host-device synchronisations inside one call of `fn`, counted by where (CUDA only):
    the frame that warned and, after `<-`, the innermost frame of this project's or diffusers'
    code that led to it (the warning's own frame is often torch's)."""
    if not torch.cuda.is_available():
        return {}
    found: collections.Counter[str] = collections.Counter()

    def show(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        if "called a synchronizing" not in str(message):  # (not the mode's own notice
            return  # that it is a prototype: the H100's one "wait" was that notice)
        ours = [f for f in traceback.extract_stack() if OURS.search(f.filename)]
        where = f"{os.path.basename(filename)}:{lineno}"
        if ours:
            where += f" <- {ours[-1].filename.split('site-packages/')[-1]}:{ours[-1].lineno}"
        found[where] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return dict(found)


def top_kernels(
    fn: Callable[[], Any], top: int = TOP, trace: str = ""
) -> tuple[float, list[tuple[str, float]]]:
    """One call of `fn` under the profiler: the sum of its kernels' device time (ms; off CUDA,
    its operators' own CPU time) and the `top` largest, by name (the whole profile written as
    a Chrome trace to `trace` where given)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        fn()
        sync()
    if trace:
        prof.export_chrome_trace(trace)
    rows = []
    for event in prof.key_averages():
        if cuda and event.device_type == DeviceType.CUDA:
            rows.append((event.key, event.self_device_time_total / 1000))
        elif not cuda and event.self_cpu_time_total > 0:
            rows.append((event.key, event.self_cpu_time_total / 1000))
    rows.sort(key=lambda r: -r[1])
    return round(sum(ms for _, ms in rows), 2), [(k[:90], round(ms, 3)) for k, ms in rows[:top]]


def probe(fn: Callable[[], Any], args: argparse.Namespace, side: str) -> dict[str, Any]:
    trace = os.path.join(args.trace_dir, f"forward-{side}.json") if args.trace_dir else ""
    with torch.inference_mode():
        times, launch = launch_and_device_ms(fn, args.runs)
        kernel_ms, top = top_kernels(fn, args.top, trace)
        found = waits(fn)
    return {
        "forward_ms": round(statistics.median(times), 2),
        "range_ms": [round(min(times), 2), round(max(times), 2)],
        "launch_ms": round(launch, 2),  # the host's, from an empty queue to the return
        "kernel_ms": kernel_ms,  # the kernels' own time: forward_ms less this is the gaps
        "syncs": found,
        "top": top,
    }


def reference(args: argparse.Namespace, s: dict[str, Any]) -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pipe = build(args.model, DTYPES[args.dtype], device)
    call = call_kwargs(pipe, s["guidance"])
    got: dict[str, Any] = {}

    def capture(module: Any, a: tuple[Any, ...], kw: dict[str, Any]) -> None:
        got["args"], got["kwargs"] = a, kw
        raise Captured

    handle = pipe.transformer.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        with torch.inference_mode():
            pipe(num_inference_steps=2, height=s["size"], width=s["size"], **call)
    except Captured:
        pass
    handle.remove()
    with torch.inference_mode():  # one eager forward first, as the pipeline's would have been
        pipe.transformer(*got["args"], **got["kwargs"])  # (Z-Image fills its RoPE table then)
    if hasattr(pipe.transformer, "fuse_qkv_projections"):
        pipe.transformer.fuse_qkv_projections()
    options = {"fullgraph": True, "dynamic": False, "mode": args.compile_mode}
    model = torch.compile(pipe.transformer, **options)
    return probe(lambda: model(*got["args"], **got["kwargs"]), args, "reference")


def server(args: argparse.Namespace, s: dict[str, Any]) -> dict[str, Any]:
    from vllm_omni_like.models.adapter import Guidance, adapter_for
    from vllm_omni_like.models.registry import family_for
    from vllm_omni_like.stages.diffusion import acceleration as accel

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pipe = build(args.model, DTYPES[args.dtype], str(device))
    adapter = adapter_for(pipe, family_for({"_class_name": type(pipe).__name__}))
    attention = accel.set_attention(pipe, "auto", device, "probe")
    tuned = accel.tune_kernels(adapter, device, attention, compiled=True)
    accel.compile_models(adapter, args.compile_mode, "inductor")
    with torch.inference_mode():
        text = adapter.encode_text([PROMPT], device, 512)
        dtype = adapter.latent_dtype(getattr(pipe, adapter.denoiser_name).dtype)
        latents = torch.randn(adapter.latent_shape(1, s["size"], s["size"]), device=device)
        latents = latents.to(dtype)
    t = torch.full((1,), 500.0, device=device)
    scale = torch.full((1,), float(s["guidance"]), device=device)
    guidance = scale if adapter.guidance is Guidance.DISTILLED else None
    out = probe(lambda: adapter.predict(latents, t, text, [500.0], guidance), args, "server")
    out["tuned"] = tuned
    return out


def main() -> None:
    ap = parser(__doc__)
    add_model(ap, "z-image-turbo", "reference,server")
    add_dtype(ap, DTYPES, "bf16")
    ap.add_argument("--size", type=int)
    ap.add_argument("--runs", type=int, default=10)
    add_compile_mode(ap)
    add_outputs(ap)
    ap.add_argument("--top", type=int, default=TOP, help="kernels kept per side")
    ap.add_argument("--trace-dir", default="", help="write each side's profile (Chrome trace)")
    args = ap.parse_args()
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    s = dict(SETTINGS.get(args.model, {"steps": 4, "guidance": 3.5, "size": 64}))
    path = arch_path(args.model) if args.model in ARCH_OPTIONS else args.model
    if family_of(path).needs_image:
        ap.error("an edit model's forward takes its source's latents too: not probed here")
    s["size"] = args.size or s["size"]
    torch.manual_seed(0)
    result: dict[str, Any] = {"size": s["size"], "dtype": args.dtype, "rows": 1}
    parts = args.parts.split(",")
    if "reference" in parts:
        result["reference"] = reference(args, s)
        torch._dynamo.reset()  # (its graphs hold the reference's weights)
        free()
    if "server" in parts:
        result["server"] = server(args, s)
    print(json.dumps(result))
    name = os.path.basename(os.path.normpath(args.model))
    path = os.path.join(args.out_dir, f"forward_probe-{device_name()}.json")
    os.makedirs(args.out_dir, exist_ok=True)
    saved: dict[str, Any] = {"models": {}}
    if os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
    saved["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    saved["models"].setdefault(name, {}).update(result)
    with open(path, "w") as f:
        json.dump(saved, f, indent=1)


if __name__ == "__main__":
    main()
