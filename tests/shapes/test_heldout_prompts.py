"""The held-out prompts of the omni rewriter (training/heldout/omni_prompts.jsonl), committed
before any training on plain English: well-formed, and naming only what the world has."""

from __future__ import annotations

import json
import os
from collections import Counter

from vllm_omni_like.shapes import world

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = os.path.join(ROOT, "training", "heldout", "omni_prompts.jsonl")
VALUES = {
    "colour": set(world.COLOURS),
    "background": set(world.COLOURS),
    "shape": set(world.SHAPES),
    "position": set(world.POSITIONS),
    "size": set(world.SIZES),
}


def _rows() -> list[dict]:
    with open(PROMPTS) as f:
        return [json.loads(line) for line in f]


def test_two_hundred_prompts_of_every_kind_the_issue_names():
    rows = _rows()
    assert len(rows) == 200
    assert len({r["id"] for r in rows}) == 200 and len({r["prompt"] for r in rows}) == 200
    kinds = Counter(r["kind"] for r in rows)
    assert kinds == {
        "issue": 10,
        "grammar": 12,
        "synonym": 30,
        "order": 22,
        "filler": 28,
        "casing": 22,
        "sentences": 22,
        "caption": 18,
        "unknown": 20,
        "outside": 16,
    }


def test_each_prompt_names_only_what_the_world_has_and_says_what_it_does_not():
    vocabulary = {w for values in VALUES.values() for v in values for w in v.split()}
    for r in _rows():
        for key, value in r["names"].items():
            assert value in VALUES[key], (r["id"], key, value)
        for word in r["unknown"]:
            assert word not in vocabulary and word.lower() in r["prompt"].lower(), r["id"]
        if r["outside"]:
            assert r["names"] == {} and r["kind"] == "outside", r["id"]
        else:
            assert r["names"], r["id"]
        if r["kind"] == "unknown":
            assert r["unknown"] and not r["outside"], r["id"]
        if r["kind"] == "caption":  # already a full caption: its scene is what it names
            scene = world.parse_caption(r["prompt"])
            assert scene is not None and {k: getattr(scene, k) for k in r["names"]} == r["names"]


def test_the_prompts_the_issue_and_the_examples_were_drawn_wrong_for_are_in_it():
    prompts = {r["prompt"] for r in _rows()}
    with open(os.path.join(ROOT, "examples", "batch.jsonl")) as f:
        batch = [json.loads(line) for line in f]
    images = [b.get("body", b)["prompt"] for b in batch if b.get("url") != "/v1/videos"]
    offline = ["red circle", "blue square at the top left", "green triangle"]  # offline_batch.py
    issue = [
        "a big yellow circle in the center on a black background",
        "red circle on a blue background",
    ]
    assert set(images + offline + issue) <= prompts
