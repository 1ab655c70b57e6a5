"""Seconds per denoising step of one small request, one device against CFG-parallel (a check
that the per-step exchange between the ranks costs little): prints a JSON line.

    python bench/cfg_steps.py --devices 0 --pair 0,1     # GPUs (cpu and cpu,cpu on a CPU)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from vllm_omni_like.config import EngineConfig
from vllm_omni_like.engine import AsyncOmni
from vllm_omni_like.inputs import OmniRequest
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.pipelines.catalog import resolve


async def one(eng: AsyncOmni, spec: str, rid: str, steps: int, size: int) -> float:
    params = GenerationParams(seed=1, num_inference_steps=steps, width=size, height=size)
    t0 = time.perf_counter()
    async for ev in eng.generate(OmniRequest(rid, "a red circle", spec, params)):
        if getattr(ev, "finished", False):
            assert ev.ok, ev.error
    return time.perf_counter() - t0


def per_step(spec: str, stage_kw: dict, steps: int, size: int) -> float:
    eng = AsyncOmni(EngineConfig(pipelines=tuple(resolve(spec, **stage_kw))))
    eng.start()
    try:
        asyncio.run(one(eng, spec, "warm", steps, size))
        short = min(asyncio.run(one(eng, spec, f"s{i}", 2, size)) for i in range(3))
        long = min(asyncio.run(one(eng, spec, f"l{i}", 2 + steps, size)) for i in range(3))
        return (long - short) / steps  # the rest of a request (encode, decode) cancels out
    finally:
        eng.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default="tiny-image")
    ap.add_argument("--devices", default="0")
    ap.add_argument("--pair", default="0,1")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--size", type=int, default=64)
    args = ap.parse_args()
    one_s = per_step(args.spec, {"devices": tuple(args.devices.split(","))}, args.steps, args.size)
    pair = {"devices": tuple(args.pair.split(",")), "cfg_parallel": True}
    two_s = per_step(args.spec, pair, args.steps, args.size)
    print(
        json.dumps(
            {
                "spec": args.spec,
                "size": args.size,
                "one_device_step_ms": round(1000 * one_s, 2),
                "cfg_parallel_step_ms": round(1000 * two_s, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
