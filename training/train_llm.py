"""Train the tiny prompt rewriter: what people type -> the caption of what gets drawn.

python training/train_llm.py --out vllm_omni_like/assets/tiny-llm      # GPU: a few minutes

The pairs come from training/prompts.py (synonyms, word order, lists, sentences, filler,
casing, punctuation, whole captions, made-up words, prompts outside the world); the tokenizer
is a byte-level BPE learnt on them. The report scores greedy rewrites of freshly generated
pairs (another seed); the hand-written held-out prompts are scored through the engine by
training/eval_omni.py.
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from common import Log, device, seed_all, write_report
from prompts import pairs

from vllm_omni_like.models.tiny_llm import build_llm_tokenizer, llm_model

TEMPLATE = "{prompt} <sep>"  # the tiny-omni pipeline's LLM prompt template
MAX_LEN = 128


def encode(tokenizer, prompts: list[str], targets: list[str]):
    """Prompt tokens are masked out of the loss: the model learns to write the caption."""
    p_ids = tokenizer([TEMPLATE.format(prompt=p) for p in prompts]).input_ids
    t_ids = tokenizer(targets, add_special_tokens=False).input_ids
    ids, labels = [], []
    for p, t in zip(p_ids, t_ids, strict=True):
        c = [*t, tokenizer.eos_token_id]
        if len(p) + len(c) > MAX_LEN:
            continue
        pad = MAX_LEN - len(p) - len(c)
        ids.append(p + c + [tokenizer.pad_token_id] * pad)
        labels.append([-100] * len(p) + c + [-100] * pad)
    return torch.tensor(ids), torch.tensor(labels)


@torch.no_grad()
def rewrite(model, tokenizer, prompts: list[str], batch: int = 256) -> list[str]:
    out_texts = []
    for i in range(0, len(prompts), batch):
        texts = [TEMPLATE.format(prompt=p) for p in prompts[i : i + batch]]
        enc = tokenizer(texts, return_tensors="pt", padding=True).to(model.device)
        out = model.generate(
            **enc, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
        out_texts += tokenizer.batch_decode(
            out[:, enc.input_ids.shape[1] :], skip_special_tokens=True
        )
    return [t.strip() for t in out_texts]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--report", default=None)
    ap.add_argument("--n", type=int, default=400_000)
    ap.add_argument("--steps", type=int, default=8000)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--eval", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--init", default=None, help="fine-tune this saved rewriter (its tokenizer)")
    args = ap.parse_args()
    seed_all(args.seed)
    dev = device()
    prompts, targets = pairs(args.n, args.seed + 1)
    if args.init:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.init)
        model = AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32).to(dev)
    else:
        tokenizer = build_llm_tokenizer(prompts[:100_000] + targets[:20_000])
        model = llm_model(tokenizer, args.hidden, args.layers).to(dev)
    ids, labels = encode(tokenizer, prompts, targets)
    print(f"{len(ids)} of {len(prompts)} pairs fit {MAX_LEN} tokens", flush=True)
    ids, labels = ids.to(dev), labels.to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * 0.5 * (1 + math.cos(math.pi * s / total))
    )
    log = Log()
    model.train()
    for step in range(total):
        idx = torch.randint(0, len(ids), (args.batch,), device=dev)
        x, y = ids[idx], labels[idx]
        width = int((x != tokenizer.pad_token_id).sum(1).max())  # right-padded: trim the tail
        x, y = x[:, :width], y[:, :width]
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            logits = model(input_ids=x, attention_mask=(x != tokenizer.pad_token_id)).logits
        loss = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.shape[-1]),
            y[:, 1:].reshape(-1),
            ignore_index=-100,
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        log(step, llm_loss=loss.item())
    model.eval()
    held_prompts, held_targets = pairs(args.eval, 10_000 + args.seed)
    got = rewrite(model, tokenizer, held_prompts)
    exact = sum(g == t for g, t in zip(got, held_targets, strict=True)) / len(got)
    misses = [(p, g, t) for p, g, t in zip(held_prompts, got, held_targets, strict=True) if g != t]
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    write_report(
        args.report or f"{args.out}/../tiny-llm-report.json",
        {
            "model": "tiny-llm",
            "tokenizer": f"byte-level BPE, {len(tokenizer)} tokens",
            "params": sum(p.numel() for p in model.parameters()),
            "train_pairs": len(ids),
            "steps": total,
            "init": args.init,
            "lr": args.lr,
            "batch": args.batch,
            "seed": args.seed,
            "generated_eval_pairs": args.eval,
            "generated_eval_exact": round(exact, 4),
            "generated_eval_misses": misses[:20],
            "held_out": "training/heldout/omni_prompts.jsonl, scored by training/eval_omni.py",
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        },
    )


if __name__ == "__main__":
    main()
