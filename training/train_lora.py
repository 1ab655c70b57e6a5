"""Train the example LoRA adapters of the embedded tiny image model on the shapes world: `pink`
draws a colour the base never learnt, `diamond` a shape it never learnt (both words the
tokenizer has: `world.ADAPTER_COLOURS`, `world.ADAPTER_SHAPES`).

    python training/train_lora.py --out examples/loras                       # both adapters
    python training/train_lora.py --out /tmp/loras --steps 300 --n 2000      # a short try

For each adapter: scenes of the world with the new word in (its colour on the shape, or its
shape; a share of plain scenes beside them, so the rest of the world stays as it was), encoded
by the base's VAE; the base frozen, a peft LoRA (rank `--rank`, alpha = rank) on the UNet's
attention and MLP linear layers (`to_q`, `to_k`, `to_v`, `to_out.0`, `ff.net.0.proj`,
`ff.net.2`: what the server's pool takes) trained with the base's diffusion loss. Evaluated
with the shapes checker (it reads pink and diamond) on prompts with the new word, through
diffusers with the adapter and without it (the base), and saved as `<name>.safetensors` in
diffusers' LoRA format (`save_lora_weights`, with peft's adapter metadata), which the server
reads with `--lora NAME=PATH` or `--lora-dir`. A report JSON goes beside each file.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import time

import numpy as np
import torch
import torch.nn.functional as F
from common import Log, seed_all, write_report

from vllm_omni_like.models.tiny import MAX_TEXT_TOKENS, ensure_tiny_model
from vllm_omni_like.shapes import checker, world

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2"]
ADAPTERS = {"pink": "colour", "diamond": "shape"}


def scene_with(name: str, rng: random.Random) -> world.Scene:
    """A training scene of adapter `name` (its word in it), never a held-out combination."""
    scene = world.sample_scene(rng)
    if ADAPTERS[name] == "shape":
        return dataclasses.replace(scene, shape=name)
    colour = name if scene.background != name else scene.colour
    return dataclasses.replace(scene, colour=colour)


def data(name: str, n: int, seed: int, plain: float) -> tuple[np.ndarray, list[str], np.ndarray]:
    """n scenes rendered, `plain` of them the base world's as they are; which have the word."""
    rng = random.Random(seed)
    found = [
        world.sample_scene(rng) if rng.random() < plain else scene_with(name, rng) for _ in range(n)
    ]
    has = np.array([getattr(s, ADAPTERS[name]) == name for s in found])
    return np.stack([world.render(s) for s in found]), [s.caption() for s in found], has


def fit_latents(vae, latents: torch.Tensor, pixels: torch.Tensor, iters: int) -> torch.Tensor:
    """Latents the frozen decoder turns into `pixels`, from the encoder's (their start).

    The base's VAE never saw the new word drawn: its encoder maps a pink shape to latents that
    decode white (the checker read pink on 3 of 40 round trips; a diamond on 17 of 40), so a
    UNet taught the encoder's latents draws what the decoder makes of them. Latents the decoder
    does draw exist (150 Adam steps on them: 16 of 16 read as pink, 16 of 16 as diamond): the
    adapter is taught those. The server's adapters touch the UNet only, so this is the way to a
    word the VAE cannot round-trip."""
    out = []
    for i in range(0, len(latents), 256):
        z = latents[i : i + 256].clone().requires_grad_(True)
        target = pixels[i : i + 256]
        opt = torch.optim.Adam([z], lr=0.05)
        for _ in range(iters):
            loss = F.mse_loss(vae.decode(z).sample, target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        out.append(z.detach())
    return torch.cat(out)


@torch.no_grad()
def round_trip_reads(vae, latents: torch.Tensor, name: str) -> float:
    """The share of `latents` (scenes with the word) the decoder draws as the word."""
    images = []
    for i in range(0, len(latents), 256):
        x = vae.decode(latents[i : i + 256]).sample.clamp(-1, 1)
        images.extend(((x + 1) * 127.5).round().permute(0, 2, 3, 1).byte().cpu().numpy())
    return read_share(images, name)


def read_share(images: list[np.ndarray], name: str) -> float:
    """The share of `images` whose `colour` / `shape` the checker reads as adapter `name`."""
    field = ADAPTERS[name]
    return round(sum(checker.read_image(im)[field] == name for im in images) / len(images), 4)


def tokens(pipe, captions: list[str]) -> torch.Tensor:
    return pipe.tokenizer(
        captions,
        padding="max_length",
        max_length=MAX_TEXT_TOKENS,
        truncation=True,
        return_tensors="pt",
    ).input_ids


def train(pipe, latents, ids, empty, steps: int, batch: int, lr: float, log: Log) -> None:
    from diffusers import DDPMScheduler

    device = latents.device
    noise_sched = DDPMScheduler.from_config(pipe.scheduler.config)
    unet = pipe.unet
    params = [p for p in unet.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    unet.train()
    with torch.no_grad():
        texts = pipe.text_encoder(torch.cat([ids, empty[None]]).to(device))[0]
    conds, blank = texts[:-1], texts[-1]
    for step in range(steps):
        idx = torch.randint(0, len(latents), (batch,), device=device)
        x0, cond = latents[idx], conds[idx].clone()
        cond[torch.rand(batch, device=device) < 0.1] = blank  # unconditional rows, for guidance
        noise = torch.randn_like(x0)
        t = torch.randint(0, noise_sched.config.num_train_timesteps, (batch,), device=device)
        pred = unet(noise_sched.add_noise(x0, noise, t), t, encoder_hidden_states=cond).sample
        loss = F.mse_loss(pred, noise)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        log(step, lora_loss=loss.item())
    unet.eval()


@torch.no_grad()
def evaluate(pipe, name: str, n: int, seed: int) -> float:
    """The share of images of prompts with the word whose `colour` / `shape` reads as it."""
    rng = random.Random(seed)
    scenes = [scene_with(name, rng) for _ in range(n)]
    images = []
    for i in range(0, n, 50):
        part = scenes[i : i + 50]
        out = pipe(
            [s.caption() for s in part],
            num_inference_steps=20,
            guidance_scale=5.0,
            generator=[torch.Generator().manual_seed(seed + i + j) for j in range(len(part))],
            output_type="np",
        )
        images.extend((out.images * 255).round().astype(np.uint8))
    return read_share(images, name)


def one(args: argparse.Namespace, name: str) -> dict:
    import diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    pipe = diffusers.StableDiffusionPipeline.from_pretrained(
        ensure_tiny_model("tiny-image"), local_files_only=True, dtype=torch.float32
    )
    pipe.set_progress_bar_config(disable=True)
    pipe.to(args.device)
    for part in (pipe.vae, pipe.text_encoder, pipe.unet):
        part.requires_grad_(False)
    images, captions, has = data(name, args.n, args.seed, args.plain)
    pixels = torch.from_numpy(images).permute(0, 3, 1, 2).float().to(args.device) / 127.5 - 1
    with torch.no_grad():
        latents = torch.cat(
            [
                pipe.vae.encode(pixels[i : i + 256]).latent_dist.mean
                for i in range(0, len(pixels), 256)
            ]
        )
    word = torch.from_numpy(has).to(args.device)
    encoded_reads = round_trip_reads(pipe.vae, latents[word][:500], name)
    fitted_reads = None
    if args.fit_latents:  # (the scenes with the word; the plain world's stay the encoder's)
        with torch.enable_grad():
            latents[word] = fit_latents(pipe.vae, latents[word], pixels[word], args.fit_latents)
        fitted_reads = round_trip_reads(pipe.vae, latents[word][:500], name)
    latents = latents * pipe.vae.config.scaling_factor
    empty = tokens(pipe, [""])[0]
    config = LoraConfig(
        r=args.rank, lora_alpha=args.rank, target_modules=TARGETS, init_lora_weights="gaussian"
    )
    pipe.unet.add_adapter(config)
    base = evaluate_without(pipe, name, args)
    started = time.perf_counter()
    train(pipe, latents, tokens(pipe, captions), empty, args.steps, args.batch, args.lr, Log())
    minutes = (time.perf_counter() - started) / 60
    found = evaluate(pipe, name, args.eval, 10_000 + args.seed)
    os.makedirs(args.out, exist_ok=True)
    meta = {k: (list(v) if isinstance(v, set) else v) for k, v in config.to_dict().items()}
    pipe.save_lora_weights(
        args.out,
        unet_lora_layers=get_peft_model_state_dict(pipe.unet),
        weight_name=f"{name}.safetensors",
        unet_lora_adapter_metadata=meta,
    )
    return {
        "adapter": name,
        "teaches": ADAPTERS[name],
        "train_scenes": args.n,
        "plain_share": args.plain,
        "steps": args.steps,
        "batch": args.batch,
        "rank": args.rank,
        "lr": args.lr,
        "seed": args.seed,
        "train_minutes": round(minutes, 2),
        "held_out_prompts": args.eval,
        "fit_latents_iters": args.fit_latents,
        f"vae_round_trip_reads_{name}_encoded": encoded_reads,
        f"vae_round_trip_reads_{name}_fitted": fitted_reads,
        f"{ADAPTERS[name]}_read_as_{name}_with_adapter": found,
        f"{ADAPTERS[name]}_read_as_{name}_base": base,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
    }


def evaluate_without(pipe, name: str, args: argparse.Namespace) -> float:
    """The base's share (the adapter off): what the adapter has to teach."""
    pipe.unet.disable_adapters()
    try:
        return evaluate(pipe, name, args.eval, 10_000 + args.seed)
    finally:
        pipe.unet.enable_adapters()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--adapters", default="pink,diamond")
    ap.add_argument("--n", type=int, default=6000)
    ap.add_argument("--plain", type=float, default=0.3, help="share of the base world's scenes")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--fit-latents",
        type=int,
        default=150,
        help="Adam steps fitting the word's latents to the frozen decoder (0: the encoder's)",
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    for name in args.adapters.split(","):
        seed_all(args.seed)
        report = one(args, name)
        print(report, flush=True)
        write_report(os.path.join(args.out, f"{name}-report.json"), report)


if __name__ == "__main__":
    main()
