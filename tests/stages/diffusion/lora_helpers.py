"""LoRA adapter files for the tests: random low-rank weights on a denoiser's linear layers,
written as diffusers/peft files (`unet.<module>.lora_A.weight`) or kohya-style SD files
(`lora_unet_<module>.lora_down.weight`, `.alpha`), as a trainer would save them; and the
test_lora*.py modules' stage, requests and runs on the embedded tiny image model (CPU fp32)."""

from __future__ import annotations

import json
import time

import numpy as np
import safetensors.torch
import torch

from vllm_omni_like.config import StageConfig
from vllm_omni_like.models.tiny import ensure_tiny_model
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.wire import StageRequest

ATTENTION_AND_MLP = ("attn1.to_q", "attn1.to_v", "attn2.to_k", "attn1.to_out.0", "ff.net.2")


def low_rank(model: torch.nn.Module, seed: int, rank: int, ends=ATTENTION_AND_MLP, std=0.3):
    """module -> (A (rank, in), B (out, rank)) for each linear layer whose name ends so."""
    g = torch.Generator().manual_seed(seed)
    found = {}
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and name.endswith(tuple(ends)):
            a = torch.randn(rank, m.in_features, generator=g) * std
            b = torch.randn(m.out_features, rank, generator=g) * std
            found[name] = (a, b)
    return found


def write_peft(path, weights, prefix="unet", alpha=None, meta=None) -> str:
    """A diffusers/peft file (with `lora_alpha` in its adapter metadata where given)."""
    tensors = {}
    for name, (a, b) in weights.items():
        tensors[f"{prefix}.{name}.lora_A.weight"] = a.contiguous()
        tensors[f"{prefix}.{name}.lora_B.weight"] = b.contiguous()
    metadata = {"format": "pt", **(meta or {})}
    if alpha is not None:
        rank = next(iter(weights.values()))[0].shape[0]
        config = {
            f"{prefix}.r": rank,
            f"{prefix}.lora_alpha": alpha,
            f"{prefix}.target_modules": sorted(weights),  # (as peft's LoraConfig saves them)
        }
        metadata["lora_adapter_metadata"] = json.dumps(config)
    safetensors.torch.save_file(tensors, str(path), metadata=metadata)
    return str(path)


def write_kohya(path, weights, alpha: float) -> str:
    """A kohya-style SD file: `lora_unet_<module with _>` keys, lora_down / lora_up, alpha."""
    tensors = {}
    for name, (a, b) in weights.items():
        key = "lora_unet_" + name.replace(".", "_")
        tensors[f"{key}.lora_down.weight"] = a.contiguous()
        tensors[f"{key}.lora_up.weight"] = b.contiguous()
        tensors[f"{key}.alpha"] = torch.tensor(float(alpha))
    safetensors.torch.save_file(tensors, str(path))
    return str(path)


STEPS = 3  # (a request's steps in the test_lora*.py modules)


def tiny_image_pipe():
    """The embedded tiny image model's diffusers pipeline, fp32 on the CPU."""
    import diffusers

    path = ensure_tiny_model("tiny-image")
    pipe = diffusers.DiffusionPipeline.from_pretrained(
        path, local_files_only=True, dtype=torch.float32
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def pipeline_image(
    pipe, stage: DiffusionStage, seed: int, prompt: str = "a red circle", steps: int = STEPS
) -> np.ndarray:
    """The diffusers pipeline's image of a stage's request (its prompt, steps and the stage's
    guidance and size), as ints."""
    rt = stage.runtime
    with torch.inference_mode():
        out = pipe(
            prompt,
            num_inference_steps=steps,
            guidance_scale=rt.defaults.guidance,
            generator=torch.Generator().manual_seed(seed),
            width=rt.defaults.width,
            height=rt.defaults.height,
            output_type="np",
        )
    return (out.images[0] * 255).round().astype(int)


def psnr(x: np.ndarray, y: np.ndarray) -> float:
    mse = float(((x.astype(float) - y.astype(float)) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


def load_lora_stage(model: str, loras, max_lora_rank: int, **kw) -> DiffusionStage:
    """A tiny model's fp32 stage on the CPU with adapters `loras`, loaded."""
    config = StageConfig(
        name="diffusion",
        kind="diffusion",
        model=model,
        dtype="float32",
        loras=loras,
        max_lora_rank=max_lora_rank,
        **kw,
    )
    stage = DiffusionStage(config)
    stage.load("cpu")
    return stage


def lora_request(rid: str, loras=(), seed: int = 3, **params) -> StageRequest:
    """A text-to-image request ("a red circle", STEPS steps unless given) naming `loras`."""
    params.setdefault("num_inference_steps", STEPS)
    p = GenerationParams(seed=seed, loras=tuple(loras), **params)
    return StageRequest(rid, "a red circle", p, mode="text2img")


def run_batch(stage: DiffusionStage, batch: list[StageRequest]) -> list:
    """The stage's outputs of one batch, each request validated first (as a worker does)."""
    for r in batch:
        stage.validate(r)
    control = StageControl(FaultInjector((), "diffusion"), None)
    return stage.begin(batch, control).finish(batch)


def run_images(stage: DiffusionStage, batch: list[StageRequest]) -> dict[str, np.ndarray]:
    """Each request's images (as ints) from one batch run by `stage`."""
    outs = run_batch(stage, batch)
    return {o.request_id: np.stack([i.pixels for i in o.images]).astype(int) for o in outs}


def run_videos(stage: DiffusionStage, batch: list[StageRequest]) -> dict[str, np.ndarray]:
    """Each request's video frames (as ints) from one batch run by `stage`."""
    return {o.request_id: o.video.frames.astype(int) for o in run_batch(stage, batch)}


def wait_read(pool, refs) -> None:
    """Until the pool's reads of the adapters `refs` are done (bounded: 60 s)."""
    deadline = time.monotonic() + 60
    while not pool.ready(refs):
        assert time.monotonic() < deadline, "the read did not end within 60 s"
        pool.wait(refs, 0.5)


def expert_files(tmp_path) -> dict[str, str]:
    """A two-expert Wan's adapters: `both` (`transformer.` keys: into both experts, as
    diffusers' load_lora_weights then again with load_into_transformer_2), and `each` (its
    `transformer.` keys into the first expert, its `transformer_2.` keys into the second)."""
    import diffusers

    from tests.models.tiny_wan22 import tiny_wan22_experts_path

    model = diffusers.WanTransformer3DModel.from_pretrained(
        tiny_wan22_experts_path(), subfolder="transformer", dtype=torch.float32
    )
    ends = ("attn1.to_q", "attn2.to_v", "ffn.net.2")
    both = write_peft(
        tmp_path / "both.safetensors", low_rank(model, 1, 4, ends, 0.5), "transformer"
    )
    first, second = low_rank(model, 2, 4, ends, 0.5), low_rank(model, 3, 2, ends[1:], 0.5)
    tensors = safetensors.torch.load_file(
        write_peft(tmp_path / "1.safetensors", first, "transformer")
    )
    for key, value in safetensors.torch.load_file(
        write_peft(tmp_path / "2.safetensors", second, "transformer_2")
    ).items():
        tensors[key] = value
    each = str(tmp_path / "each.safetensors")
    safetensors.torch.save_file(tensors, each)
    return {
        "both": both,
        "each": each,
        "1": str(tmp_path / "1.safetensors"),
        "2": str(tmp_path / "2.safetensors"),
    }
