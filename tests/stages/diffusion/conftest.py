"""The test_lora*.py modules' shared adapters and stage, built once for this package (each is
a few seconds on the CPU): the modules split the LoRA tests by what they cover, not by model."""

from __future__ import annotations

import pytest

from tests.stages.diffusion.lora_helpers import (
    load_lora_stage,
    low_rank,
    tiny_image_pipe,
    write_kohya,
    write_peft,
)


@pytest.fixture(scope="package")
def lora_files(tmp_path_factory):
    """Adapter files on the tiny image model's unet: `a` (peft), `b` (peft, alpha 4), `kohya`,
    and in `dir` (a --lora-dir) `fast` (a lightning adapter's default steps and guidance) and
    `c`."""
    root = tmp_path_factory.mktemp("loras")
    unet = tiny_image_pipe().unet
    (root / "dir").mkdir()
    return {
        "a": write_peft(root / "a.safetensors", low_rank(unet, 1, 4)),
        "b": write_peft(root / "b.safetensors", low_rank(unet, 2, 8), alpha=4.0),
        "kohya": write_kohya(root / "kohya.safetensors", low_rank(unet, 3, 4), alpha=2.0),
        "fast": write_peft(
            root / "dir" / "fast.safetensors",
            low_rank(unet, 4, 2),
            meta={"default_steps": "2", "default_guidance_scale": "1.0"},
        ),
        "c": write_peft(root / "dir" / "c.safetensors", low_rank(unet, 5, 4)),
        "dir": str(root / "dir"),
    }


@pytest.fixture(scope="package")
def lora_stage(lora_files):
    """The tiny image model's stage with `a`, `b` and `kohya` registered, `dir` as its
    --lora-dir, rank up to 8 and a pool of 4 slots."""
    loras = tuple(f"{n}={lora_files[n]}" for n in ("a", "b", "kohya"))
    s = load_lora_stage("tiny-image", loras, 8, lora_dir=lora_files["dir"], max_loras=4)
    yield s
    s.close()
