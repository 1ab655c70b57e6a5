"""What guided decoding costs per step: the token masks of a batch of 8 JSON-schema rows against
a decode step of a model with the same vocabulary. Prints a JSON line (and writes it with
`--out`).

    python bench/guided_mask.py                      # CPU
    python bench/guided_mask.py --device cuda        # GPU (the masks are still computed on the CPU)

Vocabularies: byte-level BPE of ~32k and ~150k tokens, trained here (offline, cached under
the cache dir) on the Python sources of this interpreter's stdlib and site-packages. Models:
random weights with the shapes of a ~0.5B Llama (32k) and of Qwen2.5-0.5B (151,936).

Per step, for 8 rows under one schema with free strings, arrays and numbers (rows driven along
their grammar by random allowed tokens): `mask_ms` is `Guides.masks` (llguidance fills the
batch's bitmask on its threads) plus `apply_masks` (the bitmask to -inf logits on the model's
device); `step_ms` is one forward of the batch at a 256-token context with its KV cache, then
the logits to float. Medians over `--steps` steps; the goal is mask <= 10% of a step.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sysconfig
import time

import torch

from vllm_omni_like.config import cache_dir
from vllm_omni_like.params import GuideSpec
from vllm_omni_like.stages.llm.guided import Guides, apply_masks

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "count": {"type": "integer"},
        "score": {"type": "number"},
        "nested": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "ok": {"type": "boolean"}},
            "required": ["name", "ok"],
        },
    },
    "required": ["title", "tags", "count", "score", "nested"],
}
MODELS = {  # vocabulary -> (architecture, config)
    32000: ("llama", dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                          num_attention_heads=16, num_key_value_heads=16)),
    151936: ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                           num_attention_heads=14, num_key_value_heads=2)),
}  # fmt: skip


def corpus(limit: float):
    roots = [sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"]]
    files = sorted(
        os.path.join(d, f)
        for r in roots
        for d, _, fs in os.walk(r)
        for f in fs
        if f.endswith(".py")
    )
    total = 0
    for path in files:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError:
            continue
        total += len(text)
        yield text
        if total > limit:
            return


def tokenizer(vocab: int):
    """A byte-level BPE tokenizer of `vocab` tokens (trained once, then read from the cache)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = os.path.join(cache_dir(), "bench-tokenizers", f"bpe-{vocab}.json")
    if not os.path.exists(path):
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(corpus(20e6 if vocab < 100_000 else 150e6), trainer)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tok.save(path)
    return PreTrainedTokenizerFast(tokenizer_file=path, eos_token="<|endoftext|>")


def step_ms(vocab: int, device: torch.device, batch: int, steps: int) -> float:
    from transformers import AutoConfig, AutoModelForCausalLM

    arch, shape = MODELS[vocab]
    config = AutoConfig.for_model(arch, vocab_size=vocab, **shape)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    # the KV cache's keyword: `cache` in recent transformers, `past_key_values` before
    arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.randint(0, vocab, (batch, 256), device=device)
    times = []
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        cache = getattr(out, arg)
        token = ids[:, -1:]
        for _ in range(steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model(input_ids=token, use_cache=True, **{arg: cache})
            logits = out.logits[:, -1].float()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(1000 * (time.perf_counter() - t0))
            cache = getattr(out, arg)
            token = logits.argmax(-1, keepdim=True)
    return statistics.median(times)


def mask_ms(vocab: int, device: torch.device, batch: int, steps: int) -> dict:
    hf = tokenizer(vocab)
    guides = Guides(hf, vocab)
    spec = GuideSpec("json_schema", json.dumps(SCHEMA))
    rows = [guides.start(spec) for _ in range(batch)]
    gen = torch.Generator().manual_seed(0)
    times, taken = [], 0
    for _ in range(steps):
        logits = torch.randn(batch, vocab, generator=gen).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        bitmask = guides.masks(rows)
        apply_masks(logits, bitmask, list(range(batch)))
        picked = logits.argmax(-1).tolist()  # (the step reads its tokens back anyway)
        times.append(1000 * (time.perf_counter() - t0))
        for i, row in enumerate(rows):
            if row.complete:  # a finished row starts again, so every step has 8 live rows
                rows[i] = guides.start(spec)
                continue
            row.consume(picked[i])
            taken += 1
    return {"trained_vocab": len(hf), "mask_ms": statistics.median(times),
            "mask_p90_ms": sorted(times)[steps * 9 // 10], "tokens_taken": taken}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"cpu x{os.cpu_count()}"
    result: dict = {"device": name, "batch": args.batch, "torch_threads": torch.get_num_threads()}
    for vocab in MODELS:
        masks = mask_ms(vocab, device, args.batch, args.steps)
        step = step_ms(vocab, device, args.batch, max(8, args.steps // 4))
        result[str(vocab)] = {
            **{k: round(v, 3) if isinstance(v, float) else v for k, v in masks.items()},
            "step_ms": round(step, 3),
            "mask_share": round(masks["mask_ms"] / step, 4),
        }
    line = json.dumps(result)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
