"""A discrete-event model of one replica: step-level against request-level batching on the
mixed workload of bench/step_level.py, with step costs measured on the GPU (no GPU needed).

    python bench/step_sim.py --rate 2.26 --seeds 8   # p50 / p99 / mean of each policy

What it models: one request is one row (two model rows with guidance); a lane's step costs
`a + b x model rows` (padded to the compiled buckets) at its size, measured on one H200
(bench/README.md, #36: 14.3 ms at 2 model rows, 69 ms at 30, 132-135 ms at 64, 512x512; 768x768
from the pixel ratio); finished rows decode on the critical path (an upper bound: the server
decodes them beside the next steps). Request-level: the oldest request and those of its size,
up to 32, run as a set that takes no joins. Step-level: groups join their size's lane at a step
boundary (up to 32 requests in all, 2 lanes), lanes step by the age rule (the one that waited
longest since its last step) or, with `--pick oldest`, the lane holding the oldest request;
`--lane-cap 512:16,768:8` caps a lane's rows. What it leaves out: HTTP, text encoding, the
decode's overlap, stalls. The tail is sensitive to such details (without the decode's fixed
10 ms a call, request-level's p99 comes out 8.9 s instead of 11.3): use it to choose what a GPU
sitting should measure, not as a result.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
from typing import Any

BUCKETS = (1, 8, 16, 32)
STEP_MS = {512: (8.0, 1.95), 768: (10.0, 4.6)}  # a + b x model rows
DECODE_MS = {512: (10.0, 11.0), 768: (23.0, 25.3)}  # a + b x rows (H200: 21.6 ms for 1, 95 for 8)


def bucket(n: int) -> int:
    return next((b for b in BUCKETS if n <= b), n)


def model_rows(rows: list[dict[str, Any]]) -> int:
    """As the server pads them (stages/diffusion/step.py `_forward`): a row, and its unconditional
    twin where it is guided, padded to the compiled buckets of model rows (2 per bucket of
    images: the warm-up's guided calls)."""
    rows_in = len(rows) + sum(r["cfg"] for r in rows)
    return next((2 * b for b in BUCKETS if rows_in <= 2 * b), rows_in)


def trace(n: int, rate: float, seed: int = 7) -> list[dict[str, Any]]:
    """The mix of bench/step_level.py (request 100000 + i), Poisson arrivals at `rate`."""
    arrivals, at = random.Random(seed), 0.0
    out = []
    for i in range(n):
        at += arrivals.expovariate(rate)
        rng = random.Random(100_000 + i)
        side, steps, guided = rng.choice((512, 768)), rng.randint(10, 50), rng.choice((7.5, 1.0))
        out.append({"id": i, "arr": at, "side": side, "left": steps, "cfg": guided > 1})
    return out


def admit(queue: list, lanes: list, now: float, args: argparse.Namespace) -> None:
    if args.policy == "request":
        if not lanes and queue:
            head = queue[0]
            batch = [r for r in queue if r["side"] == head["side"]][:32]
            for r in batch:
                queue.remove(r)
            lanes.append({"side": head["side"], "rows": batch, "waited": now})
        return
    while queue:  # FIFO: the head joins its lane, opens one, or everyone waits
        head = queue[0]
        lane = next((la for la in lanes if la["side"] == head["side"]), None)
        room = sum(len(la["rows"]) for la in lanes) < 32
        if lane and room and len(lane["rows"]) < args.caps.get(head["side"], 32):
            lane["rows"].append(queue.pop(0))
        elif lane is None and room and len(lanes) < 2:
            lanes.append({"side": head["side"], "rows": [queue.pop(0)], "waited": now})
        else:
            return


def run(reqs: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, float]:
    now, queue, lanes, done, i = 0.0, [], [], [], 0
    while len(done) < len(reqs):
        while i < len(reqs) and reqs[i]["arr"] <= now:
            queue.append(reqs[i])
            i += 1
        admit(queue, lanes, now, args)
        if not lanes:
            now = reqs[i]["arr"]
            continue
        if args.pick == "oldest":
            lane = min(lanes, key=lambda la: min(r["arr"] for r in la["rows"]))
        else:
            lane = min(lanes, key=lambda la: la["waited"])
        a, b = STEP_MS[lane["side"]]
        now += (a + b * model_rows(lane["rows"])) / 1000
        lane["waited"] = now
        for r in lane["rows"]:
            r["left"] -= 1
        ended = [r for r in lane["rows"] if r["left"] == 0]
        if ended:
            c, d = DECODE_MS[lane["side"]]
            now += (c + d * bucket(len(ended))) / 1000
            for r in ended:
                lane["rows"].remove(r)
                done.append(now - r["arr"])
        if not lane["rows"]:
            lanes.remove(lane)
    done.sort()
    return {
        "p50_s": round(done[len(done) // 2], 2),
        "p99_s": round(done[min(len(done) - 1, int(0.99 * len(done)))], 2),
        "mean_s": round(statistics.fmean(done), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=2.26, help="arrivals a second")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--pick", choices=("age", "oldest"), default="age")
    ap.add_argument("--lane-cap", default="", help="e.g. 512:16,768:8")
    ap.add_argument("--seeds", type=int, default=1, help="arrival traces (seeds 7, 8, ...)")
    args = ap.parse_args()
    args.caps = {int(k): int(v) for k, v in (p.split(":") for p in args.lane_cap.split(",") if p)}
    ratios = []
    for seed in range(7, 7 + args.seeds):
        reqs, p99 = trace(args.requests, args.rate, seed), {}
        for policy in ("request", "step"):
            args.policy = policy
            result = run(copy.deepcopy(reqs), args)
            p99[policy] = result["p99_s"]
            print(f"seed {seed}", policy, result)
        ratios.append(p99["step"] / p99["request"])
    median = round(statistics.median(ratios), 2)
    print("p99 step / request:", [round(r, 2) for r in ratios], "median", median)


if __name__ == "__main__":
    main()
