"""Train the tiny text-to-image model on the shapes world: the VAE first, then UNet + text encoder.

    python training/train_image.py --out vllm_omni_like/assets/tiny-image      # GPU: minutes

Reproducible (fixed seeds); runs on the CPU too, slowly. Writes a standard diffusers
StableDiffusionPipeline directory in fp16 and a report of the held-out accuracy.
"""

from __future__ import annotations

import argparse
import copy
import random

import numpy as np
import torch
import torch.nn.functional as F
from common import Log, cosine, device, scenes, seed_all, train_vae, write_report

from vllm_omni_like.models.tiny import MAX_TEXT_TOKENS, image_pipeline
from vllm_omni_like.shapes import checker


@torch.no_grad()
def encode_all(vae, pixels: torch.Tensor, batch: int = 512) -> torch.Tensor:
    return torch.cat(
        [vae.encode(pixels[i : i + batch]).latent_dist.mean for i in range(0, len(pixels), batch)]
    )


def train_denoiser(pipe, latents, ids, empty_ids, steps: int, batch: int, log: Log):
    from diffusers import DDPMScheduler

    noise_sched = DDPMScheduler.from_config(pipe.scheduler.config)
    unet, te = pipe.unet, pipe.text_encoder
    params = list(unet.parameters()) + list(te.parameters())
    opt = torch.optim.AdamW(params, lr=5e-4, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine(s, steps))
    ema = copy.deepcopy(unet).eval().requires_grad_(False)
    ema_params, unet_params = list(ema.parameters()), list(unet.parameters())
    unet.train()
    te.train()
    dev = latents.device
    for step in range(steps):
        idx = torch.randint(0, len(latents), (batch,), device=dev)
        x0, tok = latents[idx], ids[idx].clone()
        drop = torch.rand(batch, device=dev) < 0.1  # unconditional rows for guidance
        tok[drop] = empty_ids
        noise = torch.randn_like(x0)
        t = torch.randint(0, noise_sched.config.num_train_timesteps, (batch,), device=dev)
        noisy = noise_sched.add_noise(x0, noise, t)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            cond = te(tok)[0]
            pred = unet(noisy, t, encoder_hidden_states=cond).sample
        loss = F.mse_loss(pred.float(), noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        with torch.no_grad():
            torch._foreach_lerp_(ema_params, unet_params, 1 - 0.999)
        log(step, unet_loss=loss.item())
    unet.load_state_dict(ema.state_dict())
    unet.eval()
    te.eval()


@torch.no_grad()
def evaluate(pipe, n: int, seed: int, steps: int = 20, guidance: float = 5.0) -> dict:
    _, captions, _, found = scenes(n, seed, held_out=True)
    images = []
    for i in range(0, n, 50):
        gens = [torch.Generator(pipe.device).manual_seed(seed + j) for j in range(i, i + 50)]
        out = pipe(
            captions[i : i + 50],
            num_inference_steps=steps,
            guidance_scale=guidance,
            generator=gens[: len(captions[i : i + 50])],
            output_type="np",
        )
        images.extend((out.images * 255).round().astype(np.uint8))
    pairs = [
        (
            {
                "colour": s.colour,
                "background": s.background,
                "position": s.position,
                "shape": s.shape,
            },
            img,
        )
        for s, img in zip(found, images, strict=True)
    ]
    return {k: round(v, 4) for k, v in checker.accuracy(pairs).items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--report", default=None)
    ap.add_argument("--n", type=int, default=60_000)
    ap.add_argument("--vae-steps", type=int, default=2000)
    ap.add_argument("--unet-steps", type=int, default=5000)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--eval", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    seed_all(args.seed)
    dev = device()
    images, captions, _, _ = scenes(args.n, args.seed)
    pixels = torch.from_numpy(images).to(dev).permute(0, 3, 1, 2).float() / 127.5 - 1
    pipe = image_pipeline().to(dev)
    log = Log()
    vae_batch = min(args.batch, 128)
    train_vae(
        pipe.vae,
        lambda: pixels[torch.randint(0, len(pixels), (vae_batch,), device=dev)],
        args.vae_steps,
        log,
    )
    with torch.no_grad():
        latents = encode_all(pipe.vae, pixels)
    scale = float(1.0 / latents.std())
    pipe.vae.register_to_config(scaling_factor=scale)
    latents = latents * scale
    tok = pipe.tokenizer(
        captions,
        padding="max_length",
        max_length=MAX_TEXT_TOKENS,
        truncation=True,
        return_tensors="pt",
    ).input_ids.to(dev)
    empty = pipe.tokenizer(
        [""], padding="max_length", max_length=MAX_TEXT_TOKENS, return_tensors="pt"
    ).input_ids.to(dev)[0]
    train_denoiser(pipe, latents, tok, empty, args.unet_steps, args.batch, log)
    pipe.set_progress_bar_config(disable=True)
    accuracy = evaluate(pipe, args.eval, 10_000 + args.seed)
    random.seed(args.seed)
    pipe.to(torch.float16).save_pretrained(args.out)
    write_report(
        args.report or f"{args.out}/../tiny-image-report.json",
        {
            "model": "tiny-image",
            "train_scenes": args.n,
            "vae_steps": args.vae_steps,
            "unet_steps": args.unet_steps,
            "batch": args.batch,
            "seed": args.seed,
            "latent_scaling_factor": scale,
            "held_out_prompts": args.eval,
            "held_out_accuracy": accuracy,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        },
    )


if __name__ == "__main__":
    main()
