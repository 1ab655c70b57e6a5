"""The default omni pipeline (`tiny-omni`: the LLM rewriter in front of `tiny-image`) on the
held-out prompts people write (`heldout/omni_prompts.jsonl`, committed before any training on
them): what the rewriter keeps, what the picture shows, and whether prompts naming nothing the
world can draw are told so.

    python training/eval_omni.py --label baseline      # CPU: about a minute and a half
    python training/eval_omni.py --label baseline-image --pipeline tiny-image   # no rewriter

For each prompt (seed 1000 + its line number), through the real engine:
- `kept_every_named`: prompts whose revised prompt (`revised_prompt`, read back with the
  world's caption grammar) keeps every attribute the prompt names, over the prompts that name
  any and are drawable;
- `kept_attributes`: the same per attribute;
- `drawn`: what `shapes/checker.py` reads in the image, per attribute the prompt names;
- `exactly_named_and_defaults`: the revised prompt is exactly the named attributes with the
  world's defaults for the rest (`world.scene_from_named`), so a word the world lacks was not
  guessed at;
- `outside_refused`: the prompts naming nothing drawable that got a 400
  `prompt_outside_model_domain`;
- each figure per kind of prompt too. The report goes to `reports/omni-heldout-<label>.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections import defaultdict
from typing import Any

from vllm_omni_like.config import EngineConfig
from vllm_omni_like.engine import AsyncOmni
from vllm_omni_like.inputs import OmniRequest
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.pipelines.catalog import resolve
from vllm_omni_like.shapes import checker, world

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = os.path.join(HERE, "heldout", "omni_prompts.jsonl")
DRAWN = ("colour", "background", "shape", "position")  # what the checker reads


def load(path: str = PROMPTS) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


async def run_all(eng: AsyncOmni, rows: list[dict[str, Any]], pipeline: str) -> list[Any]:
    async def one(i: int, row: dict[str, Any]) -> Any:
        params = GenerationParams(seed=1000 + i)
        request = OmniRequest(row["id"], row["prompt"], pipeline, params)
        async for event in eng.generate(request):
            if getattr(event, "finished", False):
                return event
        raise RuntimeError(f"{row['id']}: no final output")

    return await asyncio.gather(*(one(i, row) for i, row in enumerate(rows)))


def score(rows: list[dict[str, Any]], outputs: list[Any]) -> dict[str, Any]:
    tally: dict[str, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))

    def note(kind: str, key: str, ok: bool) -> None:
        tally["all"][key].append(ok)
        tally[kind][key].append(ok)

    for row, out in zip(rows, outputs, strict=True):
        kind, names = row["kind"], row["names"]
        if row["outside"]:
            refused = out.error is not None and out.error.code == "prompt_outside_model_domain"
            note(kind, "outside_refused", refused)
            continue
        if out.error is not None:
            note(kind, "answered", False)
            continue
        note(kind, "answered", True)
        if out.revised_prompt is not None:  # a rewriter ran (tiny-omni)
            scene = world.parse_caption(out.revised_prompt)
            note(kind, "valid_caption", scene is not None)
            kept = {k: scene is not None and getattr(scene, k) == v for k, v in names.items()}
            for k, ok in kept.items():
                note(kind, f"kept_{k}", ok)
            note(kind, "kept_every_named", all(kept.values()))
            # the rest from the defaults, an unknown word never guessed at
            note(kind, "exactly_named_and_defaults", scene == world.scene_from_named(names))
        read = checker.read_image(out.output.images[0].pixels)
        for k in DRAWN:
            if k in names:
                note(kind, f"drawn_{k}", read.get(k) == names[k])
    rate = lambda v: {"rate": round(sum(v) / len(v), 4), "n": len(v)}  # noqa: E731
    return {g: {k: rate(v) for k, v in sorted(keys.items())} for g, keys in sorted(tally.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", required=True, help="names the report (baseline, v2, ...)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--pipeline", default="tiny-omni", help="tiny-image: the same without the LLM")
    args = ap.parse_args()
    rows = load()
    eng = AsyncOmni(EngineConfig(pipelines=tuple(resolve(args.pipeline, device=args.device))))
    eng.start()
    try:
        started = time.monotonic()
        outputs = asyncio.run(run_all(eng, rows, args.pipeline))
        seconds = time.monotonic() - started
    finally:
        eng.shutdown()
    report = {
        "prompts": len(rows),
        "set": os.path.relpath(PROMPTS, HERE),
        "label": args.label,
        "pipeline": args.pipeline,
        "seconds": round(seconds, 1),
        "scores": score(rows, outputs),
        "examples": [
            {"prompt": r["prompt"], "revised": o.revised_prompt, "error": o.error and o.error.code}
            for r, o in list(zip(rows, outputs, strict=True))[:: len(rows) // 20]
        ],
    }
    path = os.path.join(HERE, "reports", f"omni-heldout-{args.label}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    overall = report["scores"]["all"]
    print(json.dumps({k: v["rate"] for k, v in overall.items()}))


if __name__ == "__main__":
    main()
