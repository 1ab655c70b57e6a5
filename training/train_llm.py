"""Train the tiny prompt rewriter: a short prompt ("red circle") -> a full scene caption.

python training/train_llm.py --out vllm_omni_like/assets/tiny-llm      # GPU: a minute
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from common import Log, device, scenes, seed_all, write_report

from vllm_omni_like.shapes import world
from vllm_omni_like.stages.tiny_models import build_tokenizer, llm_model

TEMPLATE = "{prompt} <sep>"  # the tiny-omni pipeline's LLM prompt template
MAX_LEN = 40


def encode(tokenizer, shorts, captions):
    """Prompt tokens are masked out of the loss: the model learns to write the caption."""
    ids, labels = [], []
    for short, caption in zip(shorts, captions, strict=True):
        p = tokenizer(TEMPLATE.format(prompt=short)).input_ids
        c = [*tokenizer(caption, add_special_tokens=False).input_ids, tokenizer.eos_token_id]
        seq = (p + c)[:MAX_LEN]
        lab = ([-100] * len(p) + c)[:MAX_LEN]
        pad = MAX_LEN - len(seq)
        ids.append(seq + [tokenizer.pad_token_id] * pad)
        labels.append(lab + [-100] * pad)
    return torch.tensor(ids), torch.tensor(labels)


@torch.no_grad()
def evaluate(model, tokenizer, n: int, seed: int) -> dict:
    _, _, shorts, _ = scenes(n, seed, held_out=True)
    tokenizer.padding_side = "left"
    valid = kept = 0
    for i in range(0, n, 100):
        batch = [TEMPLATE.format(prompt=s) for s in shorts[i : i + 100]]
        enc = tokenizer(batch, return_tensors="pt", padding=True).to(model.device)
        out = model.generate(
            **enc, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
        for short, row in zip(shorts[i : i + 100], out[:, enc.input_ids.shape[1] :], strict=True):
            scene = world.parse_caption(tokenizer.decode(row, skip_special_tokens=True))
            if scene is None:
                continue
            valid += 1
            want = world.short_prompt_attributes(short)
            kept += all(getattr(scene, k) == v for k, v in want.items())
    return {"valid_caption": valid / n, "keeps_attributes": kept / n}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--report", default=None)
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--eval", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    seed_all(args.seed)
    dev = device()
    _, captions, shorts, _ = scenes(args.n, args.seed + 1)
    tokenizer = build_tokenizer(max_length=64, add_eos=False)
    ids, labels = encode(tokenizer, shorts, captions)
    ids, labels = ids.to(dev), labels.to(dev)
    model = llm_model(tokenizer).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    total = args.steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 200) * 0.5 * (1 + math.cos(math.pi * s / total))
    )
    log = Log()
    model.train()
    for step in range(total):
        idx = torch.randint(0, len(ids), (args.batch,), device=dev)
        x, y = ids[idx], labels[idx]
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            logits = model(input_ids=x, attention_mask=(x != tokenizer.pad_token_id)).logits
        loss = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]),
            y[:, 1:].reshape(-1),
            ignore_index=-100,
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        log(step, llm_loss=loss.item())
    model.eval()
    report = evaluate(model, tokenizer, args.eval, 20_000 + args.seed)
    model.save_pretrained(args.out)
    tokenizer.padding_side = "left"
    tokenizer.save_pretrained(args.out)
    write_report(
        args.report or f"{args.out}/../tiny-llm-report.json",
        {
            "model": "tiny-llm",
            "train_pairs": args.n,
            "steps": total,
            "batch": args.batch,
            "seed": args.seed,
            "held_out_prompts": args.eval,
            **report,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        },
    )


if __name__ == "__main__":
    main()
