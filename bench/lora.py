"""Many LoRA adapters in one batch against the peers' ways, on one GPU (#57).

    python bench/lora.py --model sd15                          # SD1.5 architecture (one call)
    python bench/lora.py --model flux.1-dev                    # FLUX.1-dev (one call)
    python bench/lora.py --model tiny-image --dtype fp32 --batches 2 --size 64 \\
        --compile-backend eager                                # the CPU smoke run

Both parts run our stage as a worker loads it (`--load-format dummy`: the architecture's seeded
random weights; `--compile`), each in a process of its own, and time whole batches of the
concurrency (`SETTINGS`: SD1.5 c32, 50 adapters of rank 64 drawn with Zipf popularity s = 1.1;
FLUX.1-dev c8, 8 steps, 8 adapters of rank 32), every request of a batch at its own seed; the
adapters are random, seeded, on every attention and MLP linear layer, written as
diffusers/peft safetensors files into `--lora-dir` (the same files for both parts):
- `base`: the stage without adapters: `img_s_no_lora` (a), the same requests with each
  batch split by adapter and each adapter merged into the base weights for its sub-batch and
  taken out after (the peers' hot swap: `per_batch_img_s`, b), every request the same adapter
  merged once (`img_s_merged_same`, c), and that adapter's image (merged) at a fixed seed.
- `lora`: the stage with `--lora-dir` and a pool of every adapter (`--max-loras`, ranks padded
  to `--max-lora-rank`): the mixed load in one batch (`img_s_lora`), every request the same
  adapter (`img_s_lora_same`), the same adapter's image at the same seed
  (`psnr_vs_merged_db` against the base part's), the device write of an adapter read before
  (`cold_load_s`, the median of 3), and the graphs compiled after the warm-up
  (`recompiles`: dynamo's count, a new mix of adapters in every batch).
Writes `bench/results/lora-<device>.json`: `models.<name>` with the keys of #57 -
img_s_no_lora, img_s_lora, throughput_ratio, per_batch_img_s, same_adapter_over_merged,
cold_load_s, recompiles, psnr_vs_merged_db - and the figures they are made of.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.cli_flags import add_dtype, add_model, add_outputs, parser
from bench.compare import db, psnr
from bench.raw_diffusers import DTYPES, PROMPT, merge_result

SETTINGS: dict[str, dict[str, Any]] = {
    "sd15": {"c": 32, "adapters": 50, "rank": 64, "steps": 20, "guidance": 7.5, "size": 512},
    "flux.1-dev": {"c": 8, "adapters": 8, "rank": 32, "steps": 8, "guidance": 3.5, "size": 1024},
}
SMOKE = {"c": 4, "adapters": 5, "rank": 4, "steps": 3, "guidance": 4.0, "size": 64}
ZIPF_S = 1.1
PARTS = ("base", "lora")


def settings(args: argparse.Namespace) -> dict[str, Any]:
    s = dict(SETTINGS.get(args.model, SMOKE))
    for key in ("c", "adapters", "rank", "steps", "size"):
        if getattr(args, key, None) is not None:
            s[key] = getattr(args, key)
    return s


def draws(s: dict[str, Any], batches: int, seed: int = 0) -> list[list[int]]:
    """Each batch's requests' adapters (0-based), Zipf-popular: p(k) ~ 1 / (k + 1)^s."""
    weights = 1.0 / np.arange(1, s["adapters"] + 1) ** ZIPF_S
    rng = np.random.default_rng(seed)
    picks = rng.choice(s["adapters"], size=(batches, s["c"]), p=weights / weights.sum())
    return picks.tolist()


def lora_targets(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """The denoiser's linear layers an adapter may target (models/precision.py)."""
    import fnmatch

    from vllm_omni_like.models.precision import LORA_LAYERS

    model = getattr(model, "_orig_mod", model)  # (compiled: the module it wraps)
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and any(fnmatch.fnmatchcase(name, p) for p in LORA_LAYERS)
    }


def write_adapters(model: torch.nn.Module, prefix: str, s: dict[str, Any], out: str) -> None:
    """`s["adapters"]` random adapters of rank `s["rank"]` on every target (seeded)."""
    import safetensors.torch

    os.makedirs(out, exist_ok=True)
    for k in range(s["adapters"]):
        g = torch.Generator().manual_seed(1000 + k)
        tensors = {}
        for name, m in lora_targets(model).items():
            a = torch.randn(s["rank"], m.in_features, generator=g) / m.in_features**0.5
            b = torch.randn(m.out_features, s["rank"], generator=g) * 0.02
            tensors[f"{prefix}.{name}.lora_A.weight"] = a.half()
            tensors[f"{prefix}.{name}.lora_B.weight"] = b.half()
        safetensors.torch.save_file(tensors, os.path.join(out, f"a{k}.safetensors"))


# ---- a part: our stage, loaded as a worker loads it --------------------------------------------
def note(what: str) -> None:
    """A progress line on stderr (streamed through the parent: a GPU call's log says where a
    part is when the call's limit ends it)."""
    print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def stage_of(args: argparse.Namespace, s: dict[str, Any], loras: bool) -> Any:
    """Our stage as a worker loads it; the `lora` part's batches are all of c requests (and
    one image of 1), so it compiles those two buckets only; the `base` part every bucket (the
    peers' sub-batches of an adapter each take any size)."""
    from vllm_omni_like.pipelines.catalog import resolve
    from vllm_omni_like.stages.base import create_stage

    kw: dict[str, Any] = {"dtype": args.dtype, "compile": True, "max_batch_size": s["c"]}
    if loras:
        kw["batch_buckets"] = tuple(sorted({1, s["c"]}))
    kw |= {"warmup_sizes": (f"{s['size']}x{s['size']}",), "max_side": max(s["size"], 64)}
    if args.model not in ("tiny-image",):
        kw["load_format"] = "dummy"
    if loras:
        kw |= {"lora_dir": args.lora_dir, "max_loras": s["adapters"], "max_lora_rank": s["rank"]}
    config = resolve(args.model, **kw)[0].stages[-1]
    options = dataclasses.replace(config.options, compile_backend=args.compile_backend)
    return create_stage(dataclasses.replace(config, options=options))


def requests(s: dict[str, Any], picks: list[int] | None, same: int | None = None) -> list[Any]:
    from vllm_omni_like.params import GenerationParams, LoraRef
    from vllm_omni_like.wire import StageRequest

    found = []
    for i in range(s["c"]):
        k = same if same is not None else (None if picks is None else picks[i])
        loras = () if k is None else (LoraRef(f"a{k}"),)
        p = GenerationParams(
            seed=i,
            num_inference_steps=s["steps"],
            guidance_scale=s["guidance"],
            width=s["size"],
            height=s["size"],
            loras=loras,
        )
        found.append(StageRequest(f"r{i}", PROMPT, p, mode="text2img"))
    return found


def timed(stage: Any, batches: list[list[Any]]) -> float:
    """Images a second over `batches`, each run whole (the device drained at the end)."""
    from vllm_omni_like.stages.base import StageControl
    from vllm_omni_like.stages.faults import FaultInjector

    control = StageControl(FaultInjector((), "diffusion"))
    t0 = time.perf_counter()
    images = 0
    for batch in batches:
        for r in batch:
            stage.validate(r)
        images += len(stage.execute(batch, control))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return images / (time.perf_counter() - t0)


def merge(model: torch.nn.Module, path: str, prefix: str, sign: float) -> None:
    """Add (sign 1) or take out (-1) an adapter's B @ A in the base weights (a peer's swap)."""
    import safetensors.torch

    tensors = safetensors.torch.load_file(path)
    with torch.no_grad():
        for name, m in lora_targets(model).items():
            a = tensors[f"{prefix}.{name}.lora_A.weight"].to(m.weight)
            b = tensors[f"{prefix}.{name}.lora_B.weight"].to(m.weight)
            m.weight.add_(b @ a, alpha=sign)


def image(stage: Any, s: dict[str, Any], adapter: int | None) -> np.ndarray:
    from vllm_omni_like.stages.base import StageControl
    from vllm_omni_like.stages.faults import FaultInjector

    (r,) = requests({**s, "c": 1}, None, adapter)
    (out,) = stage.execute([r], StageControl(FaultInjector((), "diffusion")))
    return out.images[0].pixels


def part_base(args: argparse.Namespace, s: dict[str, Any]) -> dict[str, Any]:
    note("base: loading and compiling the stage (every bucket warmed up)")
    stage = stage_of(args, s, loras=False)
    stage.load("cuda" if torch.cuda.is_available() else "cpu")
    note("base: loaded; writing the adapters, then timing")
    expert = stage.runtime.adapter.experts()[0]
    write_adapters(expert.model, expert.name, s, args.lora_dir)
    path = lambda k: os.path.join(args.lora_dir, f"a{k}.safetensors")  # noqa: E731
    picks = draws(s, args.batches)
    timed(stage, [requests(s, None)])  # (a first batch: nothing of the warm-up's left)
    found = {"img_s_no_lora": timed(stage, [requests(s, None) for _ in picks])}
    note(f"base: {found['img_s_no_lora']:.3f} img/s without adapters; now one adapter a batch")
    t0, images = time.perf_counter(), 0
    for batch in picks:  # one adapter a sub-batch, merged in and out (the peers' way)
        for k in sorted(set(batch)):
            merge(expert.model, path(k), expert.name, 1.0)
            sub = [r for r, pick in zip(requests(s, None), batch, strict=True) if pick == k]
            timed(stage, [sub])
            images += len(sub)
            merge(expert.model, path(k), expert.name, -1.0)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    found["per_batch_img_s"] = images / (time.perf_counter() - t0)
    note(f"base: {found['per_batch_img_s']:.3f} img/s one adapter a sub-batch; now merged")
    merge(expert.model, path(0), expert.name, 1.0)  # every request the most popular adapter
    found["img_s_merged_same"] = timed(stage, [requests(s, None) for _ in picks])
    np.save(os.path.join(args.cache_dir, "merged.npy"), image(stage, s, None))
    return found


def part_lora(args: argparse.Namespace, s: dict[str, Any]) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    from vllm_omni_like.params import LoraRef

    note("lora: loading and compiling the stage (its pool of every adapter)")
    stage = stage_of(args, s, loras=True)
    stage.load("cuda" if torch.cuda.is_available() else "cpu")
    note("lora: loaded; timing")
    pool = stage.runtime.denoise.loras
    picks = draws(s, args.batches)
    timed(stage, [requests(s, picks[0])])  # (every popular adapter written once)
    graphs = counters["stats"]["unique_graphs"]
    found = {"img_s_lora": timed(stage, [requests(s, batch) for batch in picks])}
    note(f"lora: {found['img_s_lora']:.3f} img/s, each request its adapter, in one batch")
    found["img_s_lora_same"] = timed(stage, [requests(s, None, 0) for _ in picks])
    found["recompiles"] = counters["stats"]["unique_graphs"] - graphs
    loads = []
    for k in range(s["adapters"] - 3, s["adapters"]):
        pool.evict(f"a{k}")  # (not resident: its write is timed, its file read before)
        pool.read(f"a{k}")
        t0 = time.perf_counter()
        pool.release(pool.acquire((LoraRef(f"a{k}"),)))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        loads.append(time.perf_counter() - t0)
    found["cold_load_s"] = round(statistics.median(loads), 4)
    ours = image(stage, s, 0)
    found["psnr_vs_merged_db"] = db(psnr(ours, np.load(os.path.join(args.cache_dir, "merged.npy"))))
    return found


# ---- the run ------------------------------------------------------------------------------------
def run_part(args: argparse.Namespace, part: str) -> dict[str, Any]:
    """`part` in a process of its own, over a compile cache of its own."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(args.cache_dir, part)}
    argv = [sys.executable, os.path.abspath(__file__), *sys.argv[1:], "--child", part]
    argv += ["--cache-dir", args.cache_dir, "--lora-dir", args.lora_dir]
    done = subprocess.run(argv, env=env, stdout=subprocess.PIPE, text=True)  # (stderr: ours)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {f"{part}_error": f"exit status {done.returncode} (its stderr is above)"}
    found: dict[str, Any] = json.loads(lines[-1])
    return found


def write(name: str, entry: dict[str, Any], out_dir: str) -> dict[str, Any]:
    """Merge `entry` into `models.<name>` of lora-<device>.json, the ratios once both parts
    are in."""
    with merge_result("lora", name, entry, out_dir) as m:
        for part in PARTS:  # (an error of an earlier run that this run's part did not repeat)
            if f"{part}_error" not in entry:
                m.pop(f"{part}_error", None)
        if m.get("img_s_lora") and m.get("img_s_no_lora"):
            m["throughput_ratio"] = round(m["img_s_lora"] / m["img_s_no_lora"], 4)
        if m.get("img_s_lora") and m.get("per_batch_img_s"):
            m["ours_over_per_batch"] = round(m["img_s_lora"] / m["per_batch_img_s"], 4)
        if m.get("img_s_lora_same") and m.get("img_s_merged_same"):
            m["same_adapter_over_merged"] = round(m["img_s_lora_same"] / m["img_s_merged_same"], 4)
        for key in (
            "img_s_no_lora",
            "img_s_lora",
            "per_batch_img_s",
            "img_s_lora_same",
            "img_s_merged_same",
        ):
            if key in m:
                m[key] = round(m[key], 3)
    return m


def main() -> int:
    ap = parser(__doc__)
    add_model(ap, "sd15", "base,lora", help="sd15, flux.1-dev, or tiny-image (smoke)")
    add_dtype(ap, DTYPES, "auto", auto=True)
    ap.add_argument("--batches", type=int, default=4, help="batches of c requests timed")
    ap.add_argument("--c", type=int, help="requests a batch (default: SETTINGS)")
    ap.add_argument("--adapters", type=int)
    ap.add_argument("--rank", type=int)
    ap.add_argument("--steps", type=int)
    ap.add_argument("--size", type=int, help="width and height")
    ap.add_argument("--compile-backend", default="inductor")
    ap.add_argument("--cache-dir", help="compile caches and images (default: a new one)")
    ap.add_argument("--lora-dir", help="where the adapters are written (default: a new one)")
    add_outputs(ap)
    ap.add_argument("--child", choices=PARTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    s = settings(args)
    if args.child:  # one part, in this process: its figures as the last line
        part = part_base if args.child == "base" else part_lora
        print(json.dumps(part(args, s)), flush=True)
        return 0
    args.cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="lora-bench-")
    args.lora_dir = args.lora_dir or os.path.join(args.cache_dir, "loras")
    entry: dict[str, Any] = {**s, "zipf_s": ZIPF_S, "batches": args.batches, "dtype": args.dtype}
    entry["compile_backend"] = args.compile_backend
    for part in args.parts.split(","):
        if part not in PARTS:
            ap.error(f"--parts: {part!r} is none of {', '.join(PARTS)}")
        t0 = time.perf_counter()
        entry.update(run_part(args, part))
        print(f"{part}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        print(json.dumps(write(args.model, entry, args.out_dir)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
