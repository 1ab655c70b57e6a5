"""LoRA adapter files for the tests: random low-rank weights on a denoiser's linear layers,
written as diffusers/peft files (`unet.<module>.lora_A.weight`) or kohya-style SD files
(`lora_unet_<module>.lora_down.weight`, `.alpha`), as a trainer would save them."""

from __future__ import annotations

import json

import safetensors.torch
import torch

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
