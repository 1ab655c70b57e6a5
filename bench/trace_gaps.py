"""Where a traced call's device time goes: its kernels, the device's idle gaps and the host's waits.

    python bench/trace_gaps.py TRACE.json[.gz]                  # one profile
    python bench/trace_gaps.py SERVER.json.gz REFERENCE.json    # two: what differs, by kernel

Reads torch.profiler's Chrome traces (`stages/trace.py`'s profiled batches, `bench/models.py
--trace-batch`, `bench/forward_probe.py --trace-dir`). For each: the span from the first device
activity to the last, the device's busy time in it, its idle gaps (the largest, each with the
kernel that ended it and how late the host launched that kernel: a gap the host caused starts
before the launch), the host's runtime calls that wait for the device (stream, event, device
synchronisations and copies to pageable memory) with the operators around them, and the device
time by kernel name. With two traces, the kernels whose time differs most between them.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
from typing import Any

DEVICE = {"kernel", "gpu_memcpy", "gpu_memset"}
WAITS = re.compile(r"Synchronize|cudaMemcpy(?!Async)|cudaFree\b|cudaMalloc\b")
GAP_US = 20.0  # device idle shorter than this is launch spacing, not a gap worth naming


def load(path: str) -> list[dict[str, Any]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def short(name: str) -> str:
    """A kernel's name without template arguments and inductor's numbering."""
    name = re.sub(r"<.*", "", name)
    return re.sub(r"_\d+$", "", name)[:80]


def enclosing(ops: list[dict[str, Any]], ts: float) -> list[str]:
    """The host operators (innermost last) running at `ts`."""
    around = [o for o in ops if o["ts"] <= ts <= o["ts"] + o["dur"]]
    return [o["name"][:60] for o in sorted(around, key=lambda o: -o["dur"])][-4:]


def summary(events: list[dict[str, Any]], gaps_kept: int) -> dict[str, Any]:
    device = sorted((e for e in events if e.get("cat") in DEVICE), key=lambda e: e["ts"])
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    ops = [e for e in events if e.get("cat") in ("cpu_op", "python_function", "user_annotation")]
    launches = {e["args"].get("correlation"): e for e in runtime if "args" in e}
    if not device:
        return {"device_events": 0}
    busy, gaps, end = 0.0, [], device[0]["ts"]
    for e in device:
        if e["ts"] > end + GAP_US:
            gaps.append((e["ts"] - end, end, e))
        busy += max(0.0, e["ts"] + e["dur"] - max(end, e["ts"]))
        end = max(end, e["ts"] + e["dur"])
    span = end - device[0]["ts"]
    gaps.sort(key=lambda g: -g[0])
    named = []
    for length, start, e in gaps[:gaps_kept]:
        launch = launches.get(e.get("args", {}).get("correlation"))
        entry = {"us": round(length, 1), "next": short(e["name"])}
        if launch is not None:  # > 0: launched after the device went idle (host-bound)
            entry["launched_after_idle_us"] = round(launch["ts"] - start, 1)
            entry["host"] = enclosing(ops, launch["ts"])
        named.append(entry)
    waits = collections.Counter()
    wait_us: collections.Counter[str] = collections.Counter()
    for e in runtime:
        if WAITS.search(e["name"]):
            where = " > ".join(enclosing(ops, e["ts"])) or "-"
            key = f"{e['name']} @ {where}"
            waits[key] += 1
            wait_us[key] += e["dur"]
    kernels: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in device:
        k = kernels[short(e["name"])]
        k[0] += 1
        k[1] += e["dur"] / 1000
    return {
        "device_events": len(device),
        "span_ms": round(span / 1000, 3),
        "busy_ms": round(busy / 1000, 3),
        "idle_ms": round((span - busy) / 1000, 3),
        "gaps_over_20us": len(gaps),
        "gaps_over_20us_ms": round(sum(g[0] for g in gaps) / 1000, 3),
        "largest_gaps": named,
        "host_waits": {k: [waits[k], round(wait_us[k] / 1000, 3)] for k in waits},
        "kernels": {k: [int(v[0]), round(v[1], 3)] for k, v in kernels.items()},
    }


def differ(a: dict[str, Any], b: dict[str, Any], kept: int) -> list[list[Any]]:
    """The kernels (by short name) whose device time differs most: [name, a ms, b ms, a n, b n]."""
    names = set(a["kernels"]) | set(b["kernels"])
    rows = []
    for n in names:
        ka, kb = a["kernels"].get(n, [0, 0.0]), b["kernels"].get(n, [0, 0.0])
        rows.append([n, ka[1], kb[1], ka[0], kb[0]])
    rows.sort(key=lambda r: -abs(r[1] - r[2]))
    return rows[:kept]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--gaps", type=int, default=12, help="the largest gaps named")
    ap.add_argument("--kernels", type=int, default=25, help="kernels listed (by time or by diff)")
    args = ap.parse_args()
    if len(args.traces) > 2:
        ap.error("one trace, or two to compare")
    out: dict[str, Any] = {}
    for path in args.traces:
        s = summary(load(path), args.gaps)
        top = sorted(s.get("kernels", {}).items(), key=lambda kv: -kv[1][1])[: args.kernels]
        out[path] = {**s, "kernels": dict(top)}
        out[path]["all_kernels"] = s.get("kernels", {})
    if len(args.traces) == 2:
        a, b = (out[p]["all_kernels"] for p in args.traces)
        out["differ"] = differ({"kernels": a}, {"kernels": b}, args.kernels)
    for path in args.traces:
        del out[path]["all_kernels"]
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
