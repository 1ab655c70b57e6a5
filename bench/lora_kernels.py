"""The LoRA update's kernels against each other at one layer, on one GPU (#57).

    python bench/lora_kernels.py                  # the GPU grid, bf16, eager (about a minute)
    python bench/lora_kernels.py --compile --shapes flux-attn-r32   # compiled, one shape
    python bench/lora_kernels.py --smoke --out-dir /tmp/lk          # the CPU smoke (seconds)

For each layer shape (`SHAPES`: FLUX.1's 3072-wide attention at rank 32 and 64, 4096 tokens;
SD1.5's widest and deepest self-attention levels at 512 px and its cross-attention's text K/V,
rank 64), rows 2, 8, 32 (a forward's model rows), adapters in the batch 1, 4, 8, 32 (row i
uses adapter i mod n; its other slots are slot 0, as a request of one adapter reads with
`--max-loras-per-request` K), and pools of 4, 8, 32 slots (`--max-loras`), it times, interleaved
(each repetition runs every kernel once, in turn; CUDA events; the median):
- `base`: the layer's base matmul alone (what the update adds to);
- `gather` and `pooled`: stages/diffusion/lora_kernels.py's two kernels (the pool's `choose`
  picks one by the pool's size and K);
- `grouped_mm`: a grouped GEMM (`torch._grouped_mm`, CUTLASS on sm90 for bf16) over the rows'
  (row, slot) pairs sorted by slot, group offsets from the batch's slots (a device tensor: no
  host sync, no new shape), each pair's row copied into slot order first and the pairs' updates
  summed back into their rows - a candidate, not served: it is timed to say whether its copies
  of the activations cost less than the gather's copies of A and B.
Each kernel's update is first checked against `gather`'s in float32 (a kernel that disagrees
fails the run); a kernel torch cannot run here is recorded with its error. Writes
`bench/results/lora_kernels-<device>.json`: `results` (one entry a case: the shape, rows,
adapters, pool, K, each kernel's median ms, `rule` - what `choose` picks - and `fastest`) and
`summary` (how often the rule picked the faster of gather and pooled, and the median of
pooled / gather by pool size).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.cli_flags import add_outputs, parser
from bench.masked_attention import once_ms
from bench.raw_diffusers import DTYPES, device_name
from vllm_omni_like.stages.diffusion.lora_kernels import choose, gather, pooled

SHAPES: dict[str, tuple[int, int, int, int]] = {  # name: tokens, in, out, rank
    "flux-attn-r32": (4096, 3072, 3072, 32),
    "flux-attn-r64": (4096, 3072, 3072, 64),
    "sd15-level0-r64": (4096, 320, 320, 64),
    "sd15-level2-r64": (256, 1280, 1280, 64),
    "sd15-text-kv-r64": (77, 768, 320, 64),
}
SMOKE_SHAPES = {"smoke-a": (16, 32, 24, 8), "smoke-b": (5, 16, 40, 4)}
Grid = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # rows, adapters, pools
GRID: Grid = (2, 8, 32), (1, 4, 8, 32), (4, 8, 32)
SMOKE_GRID: Grid = (2, 4), (1, 3), (4,)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}
Update = Callable[..., torch.Tensor]


def grouped_mm(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    index: torch.Tensor,
    scale: torch.Tensor,
) -> torch.Tensor:
    """The update by a grouped GEMM over the (row, slot) pairs sorted by slot (module doc)."""
    rows, tokens, width = x.shape
    per_row, slots, wide = index.shape[1], lora_a.shape[0], lora_a.shape[1]
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(slots, dtype=torch.int64, device=x.device)
    counts = counts.scatter_add(0, flat, torch.ones_like(flat))
    offs = (counts.cumsum(0) * tokens).to(torch.int32)  # (each slot's last token, exclusive)
    owner = order // per_row  # (each sorted pair's row)
    xs = x[owner].reshape(-1, width)  # (pairs x tokens, in), slot after slot
    low = torch._grouped_mm(xs, lora_a.transpose(1, 2), offs=offs)  # (pairs x tokens, wide)
    low = low.view(-1, tokens, wide) * scale.reshape(-1)[order].to(low.dtype)[:, None, None]
    up = torch._grouped_mm(low.view(-1, wide), lora_b, offs=offs).view(-1, tokens, lora_b.shape[2])
    out = torch.zeros(rows, tokens, up.shape[2], dtype=up.dtype, device=x.device)
    return out.index_add(0, owner, up)


def case(
    shape: tuple[int, int, int, int], rows: int, adapters: int, pool: int, args: Any
) -> dict[str, Any]:
    tokens, width, out, rank = shape
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    g = torch.Generator(device=device).manual_seed(rows * 1000 + adapters * 10 + pool)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g, device=device)

    a, b = randn(pool + 1, rank, width) / width**0.5, randn(pool + 1, rank, out) / rank**0.5
    a[0], b[0] = 0, 0
    index = torch.zeros(rows, args.per_row, dtype=torch.int64, device=device)
    index[:, 0] = 1 + torch.arange(rows, device=device) % adapters
    scale = torch.zeros(rows, args.per_row, device=device)
    scale[:, 0] = 0.5 + torch.rand(rows, generator=g, device=device)
    x, weight = randn(rows, tokens, width), randn(out, width) / width**0.5
    want = gather(x, a, b, index, scale)  # (float32: the reference)
    x, a, b, weight = (t.to(dtype) for t in (x, a, b, weight))
    kernels: dict[str, Update] = {"gather": gather, "pooled": pooled, "grouped_mm": grouped_mm}
    if args.compile:
        kernels = {k: torch.compile(f, dynamic=False) for k, f in kernels.items()}
    entry: dict[str, Any] = {"rows": rows, "adapters": adapters, "pool": pool, "rank": rank}
    entry |= {"tokens": tokens, "in": width, "out": out, "per_row": args.per_row}
    calls: dict[str, Callable[[], torch.Tensor]] = {"base": lambda: x @ weight.T}
    for name, fn in kernels.items():
        try:
            got = fn(x, a, b, index, scale).float()
        except (RuntimeError, NotImplementedError) as exc:  # (no kernel here for this case)
            entry[f"{name}_error"] = str(exc).splitlines()[0][:200]
            continue
        err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-12)).item()
        entry[f"{name}_rel_err"] = float(f"{err:.3g}")
        if err > TOLERANCE[dtype]:
            raise SystemExit(f"{name} disagrees with gather by {err:.3g} at {entry}")
        calls[name] = functools.partial(fn, x, a, b, index, scale)
    entry |= {f"{k}_ms": round(v, 4) for k, v in timed(calls, args.reps, device).items()}
    entry["rule"] = choose(pool, args.per_row, device)
    timed_kernels = [k for k in ("gather", "pooled", "grouped_mm") if f"{k}_ms" in entry]
    entry["fastest"] = min(timed_kernels, key=lambda k: entry[f"{k}_ms"])
    return entry


def timed(
    calls: dict[str, Callable[[], torch.Tensor]], reps: int, device: torch.device
) -> dict[str, float]:
    """Each call's median ms over `reps` interleaved repetitions (after 3 warm-up rounds)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for rep in range(reps + 3):
        for name, call in calls.items():
            ms = once_ms(call, device)
            if rep >= 3:
                times[name].append(ms)
    return {name: statistics.median(t) for name, t in times.items()}


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    both = [r for r in results if "gather_ms" in r and "pooled_ms" in r]
    agrees = [r["rule"] == min(("gather", "pooled"), key=lambda k: r[f"{k}_ms"]) for r in both]
    s: dict[str, Any] = {"cases": len(results), "rule_picks_faster": f"{sum(agrees)}/{len(both)}"}
    for pool in sorted({r["pool"] for r in both}):
        ratios = [r["pooled_ms"] / r["gather_ms"] for r in both if r["pool"] == pool]
        s[f"pooled_over_gather_pool{pool}"] = round(statistics.median(ratios), 3)
    grouped = [r["grouped_mm_ms"] / r["gather_ms"] for r in both if "grouped_mm_ms" in r]
    if grouped:
        s["grouped_mm_over_gather"] = round(statistics.median(grouped), 3)
    over_base = [r["gather_ms"] / r["base_ms"] for r in both]
    s["gather_over_base"] = round(statistics.median(over_base), 3) if over_base else None
    return s


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--per-row", type=int, default=4, help="K: --max-loras-per-request")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", help="a comma-separated subset of SHAPES")
    ap.add_argument("--compile", action="store_true", help="each kernel torch.compile'd")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, fp32, 2 reps")
    add_outputs(ap)
    args = ap.parse_args()
    shapes, grid = SHAPES, GRID
    if args.smoke:
        shapes, grid, args.dtype, args.reps = SMOKE_SHAPES, SMOKE_GRID, "fp32", 2
    if args.shapes:
        shapes = {k: shapes[k] for k in args.shapes.split(",")}
    if args.compile:  # (a compile a case: more than dynamo's default limit)
        torch._dynamo.config.recompile_limit = 10_000
    results = []
    for (name, shape), rows, adapters, pool in itertools.product(shapes.items(), *grid):
        if adapters > rows or adapters > pool:
            continue
        entry = {"shape": name, **case(shape, rows, adapters, pool, args)}
        print(json.dumps(entry), flush=True)
        results.append(entry)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    data = {"device": gpu, "torch": torch.__version__, "dtype": args.dtype}
    data |= {"compile": args.compile, "summary": summary(results), "results": results}
    path = os.path.join(args.out_dir, f"lora_kernels-{device_name()}.json")
    os.makedirs(args.out_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print(json.dumps(data["summary"]), flush=True)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
