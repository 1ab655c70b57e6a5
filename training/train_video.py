"""Train the tiny text-to-video model (Wan architecture) on clips of moving shapes.

    python training/train_video.py --out vllm_omni_like/assets/tiny-video      # GPU: minutes

The Wan VAE first (F frames of 64x64 -> 8 x (F+1)/2 x 16 x 16 latents), then the transformer
and the text encoder with flow matching, the objective WanPipeline's scheduler integrates.
Clips have 9 to 33 frames (`--frames`); a batch holds clips of one length. In every clip the
shape crosses the frame from 0.2 to 0.8 of the side, so a longer clip moves slower.
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch
import torch.nn.functional as F
from common import Log, clips, cosine, device, seed_all, train_vae, write_report

from vllm_omni_like.models.tiny import MAX_TEXT_TOKENS, video_pipeline
from vllm_omni_like.shapes import checker, world

SHIFT = 3.0  # the FlowMatchEulerDiscreteScheduler's shift in the pipeline


def batch_pixels(frames: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """uint8 [n,F,H,W,3] -> float [-1,1] [b,3,F,H,W]."""
    return frames[idx].permute(0, 4, 1, 2, 3).float() / 127.5 - 1


def text_embeds(te, ids, mask):
    """As WanPipeline does: the encoder's states, zero past each prompt's own length."""
    return te(ids, attention_mask=mask).last_hidden_state * mask[..., None]


def train_transformer(
    pipe, buckets, empty, steps: int, batch: int, log: Log, deadline: float
) -> None:
    """`buckets`: one (latents, token ids, attention mask) per clip length."""
    model, te = pipe.transformer, pipe.text_encoder
    params = list(model.parameters()) + list(te.parameters())
    opt = torch.optim.AdamW(params, lr=5e-4, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine(s, steps))
    model.train()
    te.train()
    dev = buckets[0][0].device
    for step in range(steps):
        if time.monotonic() > deadline:
            print(f"transformer: time budget reached at step {step}", flush=True)
            break
        z, ids, mask = buckets[step % len(buckets)]
        idx = torch.randint(0, len(z), (batch,), device=dev)
        x0, tok, m = z[idx], ids[idx].clone(), mask[idx].clone()
        drop = torch.rand(batch, device=dev) < 0.1
        tok[drop], m[drop] = empty[0], empty[1]
        u = torch.rand(batch, device=dev)
        sigma = SHIFT * u / (1 + (SHIFT - 1) * u)
        noise = torch.randn_like(x0)
        s = sigma.view(-1, 1, 1, 1, 1)
        xt = (1 - s) * x0 + s * noise
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            cond = text_embeds(te, tok, m)
            pred = model(
                hidden_states=xt,
                timestep=sigma * 1000,
                encoder_hidden_states=cond,
                return_dict=False,
            )[0]
        loss = F.mse_loss(pred.float(), noise - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        log(step, flow_loss=loss.item())
    model.eval()
    te.eval()


@torch.no_grad()
def evaluate(pipe, n: int, seed: int, num_frames: int = 9) -> dict:
    rng = random.Random(seed)
    found = [world.sample_clip(rng) for _ in range(n)]
    moved = coloured = 0
    for i in range(0, n, 25):
        part = found[i : i + 25]
        gens = [torch.Generator(pipe.device).manual_seed(seed + i + j) for j in range(len(part))]
        out = pipe(
            [c.caption() for c in part],
            num_frames=num_frames,
            height=64,
            width=64,
            num_inference_steps=20,
            guidance_scale=5.0,
            generator=gens,
            output_type="np",
            max_sequence_length=MAX_TEXT_TOKENS,
        )
        for clip, video in zip(part, out.frames, strict=True):
            frames = (np.clip(video, 0, 1) * 255).round().astype(np.uint8)
            moved += checker.motion(frames) == clip.direction
            coloured += checker.read_image(frames[len(frames) // 2])["colour"] == clip.colour
    return {"direction": moved / n, "shape_colour": coloured / n}


def _frames_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--report", default=None)
    ap.add_argument("--n", type=int, default=12_000, help="training clips, over all lengths")
    ap.add_argument("--frames", default="9,13,17,21,25,29,33", help="clip lengths trained on")
    ap.add_argument("--eval-frames", default="9,17,33", help="clip lengths evaluated")
    ap.add_argument("--vae-steps", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=8000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vae-batch", type=int, default=32)
    ap.add_argument("--vae-lr", type=float, default=1e-3, help="lower to fine-tune (--init)")
    ap.add_argument("--eval", type=int, default=100, help="held-out clips per evaluated length")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--minutes", type=float, default=60.0, help="time budget for training")
    ap.add_argument("--vae-share", type=float, default=0.35, help="share of the budget")
    ap.add_argument("--init", default=None, help="a saved tiny-video directory to continue")
    args = ap.parse_args()
    start = time.monotonic()
    seed_all(args.seed)
    torch.backends.cudnn.benchmark = True
    dev = device()
    lengths = _frames_list(args.frames)
    data = []  # per length: (uint8 frames on the device, captions)
    for k, length in enumerate(lengths):
        frames_np, captions, _ = clips(args.n // len(lengths), args.seed + 2 + 1000 * k, 0, length)
        data.append((torch.from_numpy(frames_np).to(dev), captions))
    print(f"rendered {args.n} clips of {lengths} frames in {time.monotonic() - start:.1f}s")
    if args.init:  # continue from an earlier run's weights
        from diffusers import WanPipeline

        pipe = WanPipeline.from_pretrained(args.init, dtype=torch.float32).to(dev)
    else:
        pipe = video_pipeline().to(dev)
    log = Log()
    budget = args.minutes * 60
    vae_batch = args.vae_batch
    vae_step = [0]

    def vae_sample() -> torch.Tensor:
        frames = data[vae_step[0] % len(data)][0]
        vae_step[0] += 1
        return batch_pixels(frames, torch.randint(0, len(frames), (vae_batch,), device=dev))

    train_vae(
        pipe.vae, vae_sample, args.vae_steps, log, start + args.vae_share * budget, args.vae_lr
    )
    with torch.no_grad():
        latents = [
            torch.cat(
                [
                    pipe.vae.encode(
                        batch_pixels(frames, torch.arange(i, min(i + 64, len(frames)), device=dev))
                    ).latent_dist.mean
                    for i in range(0, len(frames), 64)
                ]
            )
            for frames, _ in data
        ]
    flat = torch.cat([z.transpose(1, 2).flatten(0, 1) for z in latents])  # [N*T, C, H, W]
    mean = flat.mean(dim=(0, 2, 3))
    std = flat.std(dim=(0, 2, 3))
    pipe.vae.register_to_config(latents_mean=mean.tolist(), latents_std=std.tolist())
    buckets = []
    for z, (_, captions) in zip(latents, data, strict=True):
        enc = pipe.tokenizer(
            captions,
            padding="max_length",
            max_length=MAX_TEXT_TOKENS,
            truncation=True,
            return_tensors="pt",
        )
        z = (z - mean.view(1, -1, 1, 1, 1)) / std.view(1, -1, 1, 1, 1)
        buckets.append((z, enc.input_ids.to(dev), enc.attention_mask.to(dev)))
    e = pipe.tokenizer([""], padding="max_length", max_length=MAX_TEXT_TOKENS, return_tensors="pt")
    empty = (e.input_ids[0].to(dev), e.attention_mask[0].to(dev))
    train_transformer(pipe, buckets, empty, args.steps, args.batch, log, start + budget)
    pipe.set_progress_bar_config(disable=True)
    per_length = {}
    for length in _frames_list(args.eval_frames):
        per_length[str(length)] = evaluate(pipe, args.eval, 30_000 + args.seed, length)
        print(f"eval {length} frames: {per_length[str(length)]}", flush=True)
    pipe.to(torch.float16).save_pretrained(args.out)
    write_report(
        args.report or f"{args.out}/../tiny-video-report.json",
        {
            "model": "tiny-video",
            "train_clips": args.n,
            "train_frames": lengths,
            "vae_steps": args.vae_steps,
            "vae_batch": args.vae_batch,
            "vae_lr": args.vae_lr,
            "steps": args.steps,
            "batch": args.batch,
            "seed": args.seed,
            "init": args.init,
            "eval_clips_per_length": args.eval,
            "eval": per_length,
            "minutes": round((time.monotonic() - start) / 60, 2),
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        },
    )


if __name__ == "__main__":
    main()
