"""Today's image models served against plain diffusers at its best, batch-1 latency (#37, #38).

    python bench/models.py --model flux.1-dev --parts reference      # one GPU call
    python bench/models.py --model flux.1-dev --parts server         # the next, same machine
    python bench/models.py --model /tmp/tiny-flux --dtype fp32        # a CPU smoke run

One model per GPU sitting (its weights take most of the GPU: the reference and the server run
one after the other, the reference's images kept in `--state` for the image check). Random
weights (`--load-format dummy`'s seeded recipe: both compute the same images), bf16, batch 1,
the model's published settings (`SETTINGS`; `--steps`, `--guidance`, `--size` override). An
edit-only model (Qwen-Image-Edit) edits `edit_source`: the pipeline gets it as an image, the
server as a PNG upload to /v1/images/edits.
- reference: the diffusers pipeline, eager (`diffusers_s`), then compiled at its best
  (`diffusers_compiled_s`): fused QKV projections, the transformer and the VAE decoder under
  `torch.compile(fullgraph=True, dynamic=False)` in the same mode as the server, and the
  fastest of diffusers' attention backends available (two eager steps each: `attention`).
- server: `vllm-omni-like serve <model> --load-format dummy --dtype bf16 --compile` (warm-up
  at the size), the same requests over HTTP, end to end (`server_s`: the median).
Writes `bench/results/models-<device>.json`: `models.<name>` with `server_s`, `diffusers_s`,
`diffusers_compiled_s`, `ratio_vs_compiled`, `peer_s` and `peer_source` (a peer's published
figure at the same settings, where there is one), `images_equal` (PSNR >= 35 dB).
"""

from __future__ import annotations

import argparse
import inspect
import io
import itertools
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import httpx
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench import reference_state
from bench.cli_flags import add_compile_mode, add_dtype, add_model, add_outputs, parser
from bench.compare import psnr
from bench.raw_diffusers import DTYPES, PROMPT, device_name, free, sync
from bench.server_proc import Server, histograms, keep_timeline, pixels, png_bytes
from bench.step_profile import host_spans, step_timeline
from vllm_omni_like.media import PNG_COMPRESS_LEVEL
from vllm_omni_like.models.registry import family_of
from vllm_omni_like.pipelines.catalog import ARCH_OPTIONS, arch_path
from vllm_omni_like.stages.trace import TRACE_BATCHES_ENV as TRACE_BATCHES
from vllm_omni_like.stages.trace import TRACE_DIR_ENV as TRACE_DIR

# the settings per model: steps, guidance, side; a peer's figure where published
SETTINGS: dict[str, dict[str, Any]] = {
    "flux.1-dev": {"steps": 28, "guidance": 3.5, "size": 1024, "peer_s": 4.30},
    "flux.1-schnell": {"steps": 4, "guidance": 0.0, "size": 1024},
    "sd3.5-large": {"steps": 28, "guidance": 3.5, "size": 1024},
    "sd3.5-medium": {"steps": 40, "guidance": 4.5, "size": 1024},
    "qwen-image": {"steps": 50, "guidance": 4.0, "size": 1024, "peer_s": 12.8},
    "z-image-turbo": {"steps": 8, "guidance": 0.0, "size": 1024},
    "sdxl": {"steps": 30, "guidance": 5.0, "size": 1024},
    # edits `edit_source` by instruction, at the upload's size (its pipeline fits the image to
    # about a megapixel for the VAE and Qwen2.5-VL: 1024x1024 here)
    "qwen-image-edit": {"steps": 50, "guidance": 4.0, "size": 1024},
}
PEER_SOURCE = {
    "flux.1-dev": "xDiT's published FLUX.1-dev 1024x1024 28-step latency on one H100",
    "qwen-image": "a peer's published Qwen-Image 1024x1024 50-step CFG 4 latency on one H100",
}
STEP_MS: list[float] = []  # the last call's steps on the device (from the second step's end)
LEAD_MS: list[float] = []  # the last call's start to its first step's end, on the device
ATTENTION = ("native", "_native_cudnn", "_native_flash", "flash")  # diffusers' backends


def build(model: str, dtype: torch.dtype, device: str) -> Any:
    from vllm_omni_like.stages.torch_utils import dummy_pipeline

    path = arch_path(model) if model in ARCH_OPTIONS else model
    own = family_of(path).adapter_class().own_components(path)  # (Qwen-Image-Edit's processor)
    pipe = dummy_pipeline(path, torch.device(device), dtype, own).to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call_kwargs(pipe: Any, guidance: float) -> dict[str, Any]:
    """The text and guidance arguments the server's adapter gives the pipeline for one prompt
    (T5's length, an empty negative prompt, Qwen-Image's true CFG scale and " " negative)."""
    from vllm_omni_like.models.adapter import adapter_for
    from vllm_omni_like.models.registry import family_for

    adapter = adapter_for(pipe, family_for({"_class_name": type(pipe).__name__}))
    kwargs = adapter.text_kwargs([PROMPT], [""], getattr(pipe, "tokenizer", None))
    return {**kwargs, **adapter.guidance_kwargs(guidance)}


def call(pipe: Any, seed: int, s: dict[str, Any]) -> tuple[np.ndarray, float]:
    """One image through the pipeline, as the server asks it, and its PNG as a diffusers user
    writes it (PIL, the server's default level): (pixels, seconds). Each step's end is an
    event on the device's clock (`STEP_MS` gets the steps' durations)."""
    from PIL import Image

    device, marks = pipe.device, []

    def on_step_end(pipe: Any, i: int, t: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
        if device.type == "cuda":
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[-1].record()
        return kwargs

    sync()
    t0 = time.perf_counter()
    start = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
    if start is not None:
        start.record()
    out = pipe(
        generator=[torch.Generator(device=device).manual_seed(seed)],
        num_inference_steps=s["steps"],
        height=s["size"],
        width=s["size"],
        output_type="np",
        callback_on_step_end=on_step_end,
        # fresh lists: ZImagePipeline writes its chat template into the prompt list it gets
        # (a list kept across calls grew by a template a call: a new length, a recompile)
        **{k: list(v) if isinstance(v, list) else v for k, v in s["call"].items()},
        **({"image": Image.fromarray(edit_source(s["size"]))} if s.get("edit") else {}),
    ).images
    pixels = (out[0] * 255).round().astype(np.uint8)
    Image.fromarray(pixels).save(io.BytesIO(), format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    seconds = time.perf_counter() - t0
    STEP_MS[:] = [a.elapsed_time(b) for a, b in itertools.pairwise(marks)]
    LEAD_MS[:] = [start.elapsed_time(marks[0])] if start is not None and marks else []
    return pixels, seconds


def edit_source(side: int) -> np.ndarray:
    """The image an edit model edits: smooth colour ramps with a disc (deterministic)."""
    yy, xx = np.mgrid[0:side, 0:side] / side
    disc = ((xx - 0.5) ** 2 + (yy - 0.5) ** 2 < 0.1) * 0.5
    rgb = np.stack([xx, yy, np.clip(1 - xx - yy + disc, 0, 1)], -1)
    return (rgb * 255).round().astype(np.uint8)


def timed(
    pipe: Any, s: dict[str, Any], runs: int
) -> tuple[float, dict[int, np.ndarray], float, float | None]:
    """(median seconds, images by seed, median step ms on the device of all runs, median lead
    ms - the call's start to its first step's end: the text encoders, the latents' set-up and
    one step - or None off CUDA)."""
    call(pipe, 0, s)  # warm-up (compiles, if compiled)
    times, images, steps, leads = [], {}, [], []
    for seed in range(runs):
        images[seed], seconds = call(pipe, seed, s)
        times.append(seconds)
        steps += STEP_MS
        leads += LEAD_MS
    step_ms = statistics.median(steps) if steps else 0.0
    return statistics.median(times), images, step_ms, statistics.median(leads) if leads else None


def denoiser(pipe: Any) -> Any:
    """The pipeline's denoiser: its UNet (SD, SDXL) or its transformer."""
    return pipe.unet if getattr(pipe, "unet", None) is not None else pipe.transformer


def fastest_attention(pipe: Any, s: dict[str, Any]) -> str:
    """The fastest attention backend diffusers runs here for this model (two eager steps); a
    UNet keeps its processors (PyTorch SDPA)."""
    if getattr(pipe, "unet", None) is not None:
        return "sdpa (the UNet's processors)"
    best, name = float("inf"), "native"
    one = {**s, "steps": 2}  # (one step is undefined for some schedules)
    for backend in ATTENTION:
        try:
            pipe.transformer.set_attention_backend(backend)
            call(pipe, 0, one)
            seconds = min(call(pipe, 0, one)[1] for _ in range(2))
        except Exception as exc:  # not installed, not for this GPU or these shapes
            print(f"attention {backend}: {type(exc).__name__}", file=sys.stderr)
            continue
        print(f"attention {backend}: {seconds:.3f} s for a two-step call", file=sys.stderr)
        if seconds < best:
            best, name = seconds, backend
    pipe.transformer.set_attention_backend(name)
    return name


def part_reference(args: argparse.Namespace, s: dict[str, Any]) -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pipe = build(args.model, DTYPES[args.dtype], device)
    s["call"] = call_kwargs(pipe, s["guidance"])
    result = {}
    if not args.no_eager:
        eager_s = timed(pipe, s, args.runs)[0]
        print(f"diffusers eager: {eager_s:.3f} s", file=sys.stderr)
        result["diffusers_s"] = round(eager_s, 3)
    model = denoiser(pipe)
    if "encoder_hidden_states_mask" in inspect.signature(model.forward).parameters:
        result["text_mask_cost_ms"] = mask_cost(pipe, s["size"], args.runs * 3)
    # (a CPU smoke run over a tiny directory takes this same path: what a GPU sitting runs)
    result["attention"] = fastest_attention(pipe, s)
    # Z-Image's has none; SD3.5's fused processor would skip its QK norms (a wrong image)
    if hasattr(model, "fuse_qkv_projections") and not drops_qk_norms(model):
        model.fuse_qkv_projections()
    if model is getattr(pipe, "unet", None):  # diffusers' own advice for a compiled UNet
        model.to(memory_format=torch.channels_last)
        pipe.vae.to(memory_format=torch.channels_last)
    options = {"fullgraph": True, "dynamic": False, "mode": args.compile_mode}
    name = "unet" if model is getattr(pipe, "unet", None) else "transformer"
    if args.regional:  # diffusers' regional compile: each repeated block's class once
        model.compile_repeated_blocks(**options)
        result["compile"] = "regional"
    else:
        setattr(pipe, name, torch.compile(model, **options))
    pipe.vae.decoder = torch.compile(pipe.vae.decoder, **options)
    compiled_s, images, step_ms, lead_ms = timed(pipe, s, args.runs)
    print(f"diffusers compiled: {compiled_s:.3f} s", file=sys.stderr)
    result["diffusers_compiled_s"] = round(compiled_s, 3)
    result["diffusers_compiled_step_ms"] = round(step_ms, 2)
    if lead_ms is not None:
        result["diffusers_compiled_lead_ms"] = round(lead_ms, 2)
    reference_state.save(args.state, {str(k): v for k, v in images.items()}, args.state_meta)
    del pipe
    free()
    return result


def mask_cost(pipe: Any, side: int, runs: int) -> dict[str, float]:
    """The eager transformer's forward of true CFG's two rows (a prompt of 34 tokens, " " of 6)
    padded to the first text bucket, masked as the server runs it, against the same length
    unmasked (no mask: every token attended; ms, medians on the device's clock)."""
    from bench.masked_attention import clock
    from vllm_omni_like.models.adapter import adapter_for
    from vllm_omni_like.models.registry import family_for
    from vllm_omni_like.models.text_buckets import TEXT_BUCKETS

    adapter = adapter_for(pipe, family_for({"_class_name": type(pipe).__name__}))
    config, dev, dtype = pipe.transformer.config, pipe.device, pipe.transformer.dtype
    latents = torch.randn(2, config.in_channels // 4, side // 8, side // 8, device=dev, dtype=dtype)
    embeds = torch.randn(2, TEXT_BUCKETS[0], config.joint_attention_dim, device=dev, dtype=dtype)
    mask = torch.ones(2, TEXT_BUCKETS[0], dtype=torch.long, device=dev)
    mask[0, 34:], mask[1, 6:] = 0, 0
    t = torch.full((2,), 500.0, device=dev)
    out = {}
    with torch.inference_mode():
        for name, m in (("masked", mask), ("unmasked", None)):
            text = {"embeds": embeds, "mask": m}
            out[name] = round(
                clock(lambda text=text: adapter.predict(latents, t, text), runs, dev), 2
            )
    print(f"text mask: {out}", file=sys.stderr)
    return out


def drops_qk_norms(model: torch.nn.Module) -> bool:
    """diffusers' fused joint-attention processor (SD3's) applies no `norm_q`/`norm_k`: an
    SD3.5 fused is another model. (Until 2026-12-06 both sides fused it: the SD3.5 figures of
    earlier sittings timed that.)"""
    is_sd3 = type(model).__name__ == "SD3Transformer2DModel"
    return is_sd3 and any(getattr(m, "norm_q", None) is not None for m in model.modules())


def part_server(args: argparse.Namespace, s: dict[str, Any]) -> dict[str, Any]:
    # another model's (or settings') reference is refused here, before the server starts
    ref = reference_state.load(args.state, args.state_meta)
    side = f"{s['size']}x{s['size']}"
    flags = [args.model, "--load-format", "dummy", "--dtype", args.dtype]
    flags += ["--max-side", str(max(s["size"], 64)), "--gpu-memory-fraction", "0.9"]
    flags += ["--compile", "--compile-mode", args.compile_mode, "--batch-buckets", "1"]
    flags += ["--warmup-size", side, *shlex.split(args.server_flags)]
    if args.regional:
        flags += ["--regional-compile", "on"]
    timeline = tempfile.mkdtemp(prefix="models-timeline-")  # each step on the device
    traced = str(args.trace_batch or "")  # (by default no profiled batch)
    env = {**os.environ, TRACE_DIR: timeline, TRACE_BATCHES: traced}
    server = Server(flags, args.log, 1800, env=env)
    since = float("inf")
    # one client for all (a client's creation alone takes ~50 ms: its TLS context)
    client = httpx.Client(timeout=600)
    try:
        body = {"prompt": PROMPT, "size": side, "num_inference_steps": s["steps"]}
        body |= {"guidance_scale": s["guidance"], "response_format": "b64_json"}
        times, got, before = [], {}, {}
        spans: list[tuple[float, float]] = []  # each request's send and end (monotonic)
        source = png_bytes(edit_source(s["size"])) if s.get("edit") else b""
        for seed in [0, *range(args.runs)]:  # (the first: a warm-up)
            if len(times) == 1:
                before = histograms(server.url)
            t0, sent = time.perf_counter(), time.monotonic()
            if s.get("edit"):  # the same fields as a form, the image as a PNG upload
                form = {k: str(v) for k, v in {**body, "seed": seed}.items()}
                files = {"image": ("source.png", source, "image/png")}
                r = client.post(f"{server.url}/v1/images/edits", data=form, files=files)
            else:
                r = client.post(f"{server.url}/v1/images/generations", json={**body, "seed": seed})
            r.raise_for_status()
            times.append(time.perf_counter() - t0)
            spans.append((sent, time.monotonic()))
            got[seed] = pixels(r)
            since = min(since, time.monotonic())  # (the timed requests' sets begin after)
        after = histograms(server.url)
        if args.trace_batch:  # one more, not timed: the batch the server profiles, if counted right
            client.post(f"{server.url}/v1/images/generations", json={**body, "seed": 0})
    finally:
        client.close()
        server.stop()
    result: dict[str, Any] = {"server_s": round(statistics.median(times[1:]), 3)}
    result["server_start_s"] = round(server.start_s, 1)
    # where a request's time went, server side (means of the timed requests, /metrics)
    result["server_parts_s"] = {
        k: round((after[k][0] - before.get(k, (0, 0))[0]) / n, 4)
        for k in after
        if (n := after[k][1] - before.get(k, (0, 0))[1])
    }
    steps = step_timeline(timeline, s["steps"], since)
    result["server_host_ms"] = host_spans(timeline, spans[1:])
    keep_timeline(timeline, os.path.join(args.out_dir, f"models-{device_name()}-timeline.jsonl"))
    for name in os.listdir(timeline):  # the profiled batch's Chrome trace (`--trace-batch`)
        if name.endswith((".json.gz", "-memory.pickle")):  # (and VLLM_OMNI_LIKE_TRACE_MEMORY's)
            shutil.copy(os.path.join(timeline, name), os.path.join(args.out_dir, name))
    if 1 in steps["step_ms_by_rows"]:
        result["server_step_ms"] = steps["step_ms_by_rows"][1]
    result["server_lead_ms"], result["server_join_ms"] = steps["lead_ms"], steps["join_ms"]
    if ref is not None:
        values = [psnr(got[int(k)], ref[k]) for k in ref if int(k) in got]
        result["psnr_db"] = [round(v, 2) if np.isfinite(v) else "inf" for v in values]
        result["images_equal"] = all(v >= 35 for v in values)
    return result


def write(name: str, entry: dict[str, Any], out_dir: str, prefix: str = "models") -> dict[str, Any]:
    """Merge `entry` into `models.<name>` of <prefix>-<device>.json; the ratio once both sides
    are in."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{prefix}-{device_name()}.json")
    data: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "models": {},
    }
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    merged = {**data["models"].get(name, {}), **entry}
    if "server_s" in merged and "diffusers_compiled_s" in merged:
        merged["ratio_vs_compiled"] = round(merged["server_s"] / merged["diffusers_compiled_s"], 4)
    data["models"][name] = merged
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    return merged


def main() -> int:
    ap = parser(__doc__)
    add_model(ap, "flux.1-dev", "reference,server")
    add_dtype(ap, DTYPES, "bf16")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--guidance", type=float)
    ap.add_argument("--size", type=int)
    ap.add_argument("--runs", type=int, default=3)
    add_compile_mode(ap)
    ap.add_argument("--no-eager", action="store_true", help="time the compiled reference only")
    ap.add_argument(
        "--state",
        help="the reference's images (default: /tmp/models-reference-<model>[-<override>].npz)",
    )
    add_outputs(ap, log="models.log")
    # the server profiles its N-th batch, the warm-up's counted (Z-Image's warm-up is 7 batches:
    # with --runs 3, 12 is one more request after the timed ones); its trace lands in --out-dir
    ap.add_argument("--trace-batch", type=int, default=0)
    # both sides compiled a block at a time (diffusers' `compile_repeated_blocks`, the server's
    # `--regional-compile on`): a start in minutes where a whole compile of every warm-up shape
    # does not fit a call (Qwen-Image); results under "<model> (regional)"
    ap.add_argument("--regional", action="store_true")
    ap.add_argument("--server-flags", default="", help="more `serve` flags, one string")
    args = ap.parse_args()
    base = SETTINGS.get(args.model, {"steps": 4, "guidance": 3.5, "size": 64})
    given = {"steps": args.steps, "guidance": args.guidance, "size": args.size}
    s = {**base, **{k: v for k, v in given.items() if v is not None}}
    path = arch_path(args.model) if args.model in ARCH_OPTIONS else args.model
    s["edit"] = family_of(path).needs_image  # an edit-only model edits `edit_source`
    name = os.path.basename(os.path.normpath(args.model))
    given |= {"dtype": None if args.dtype == "bf16" else args.dtype}
    args.state = args.state or reference_state.default_path("models", args.model, given)
    args.state = reference_state.npz_path(args.state)
    args.state_meta = {"model": name, "dtype": args.dtype, "edit": s["edit"]}
    args.state_meta |= {k: s[k] for k in ("steps", "guidance", "size")}
    entry: dict[str, Any] = {"steps": s["steps"], "guidance": s["guidance"], "size": s["size"]}
    entry["dtype"], entry["compile_mode"] = args.dtype, args.compile_mode
    if "peer_s" in s:
        entry["peer_s"], entry["peer_source"] = s["peer_s"], PEER_SOURCE[name]
    for part in args.parts.split(","):
        entry.update((part_reference if part == "reference" else part_server)(args, s))
        key = f"{name} (regional)" if args.regional else name
        print(json.dumps(write(key, entry, args.out_dir)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
