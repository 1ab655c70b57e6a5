"""LoRA adapters by name (vllm_omni_like/loras.py): registration by flag and YAML, names that
never leave `--lora-dir`, pickle files refused, and the stages that take adapters."""

from __future__ import annotations

import os

import pytest

from vllm_omni_like.config import StageConfig
from vllm_omni_like.errors import ConfigError
from vllm_omni_like.loras import LoraSpec, check_name, in_directory, resolve, served


@pytest.mark.parametrize("name", ["a", "anime-v2", "x_1.5", "A" * 64])
def test_a_name_is_letters_digits_and_a_few_marks(name):
    assert check_name(name) is None


@pytest.mark.parametrize("name", ["", "../a", "a/b", ".hidden", "a..b", "a b", "A" * 65, "c:\\x"])
def test_a_name_that_could_leave_a_directory_is_refused(name):
    assert check_name(name) is not None


def test_a_directory_answers_its_own_safetensors_files_only(tmp_path):
    inside, outside = tmp_path / "loras", tmp_path / "elsewhere"
    inside.mkdir()
    outside.mkdir()
    (inside / "good.safetensors").write_bytes(b"x")
    (inside / "old.ckpt").write_bytes(b"x")
    (outside / "secret.safetensors").write_bytes(b"x")
    os.symlink(outside / "secret.safetensors", inside / "link.safetensors")
    os.symlink(outside, inside / "sub")
    assert in_directory(str(inside), "good") == os.path.realpath(inside / "good.safetensors")
    for name in ("old", "link", "sub/secret", "../elsewhere/secret", "missing"):
        assert in_directory(str(inside), name) is None, name
    assert served((LoraSpec("a", "/x/a.safetensors"),), str(inside)) == ["a", "good"]
    assert resolve("good", (), str(inside)) == LoraSpec("good", in_directory(str(inside), "good"))
    assert resolve("good", (), None) is None


def test_registration_by_flag_and_by_yaml(tmp_path):
    from vllm_omni_like.cli import build_parser
    from vllm_omni_like.flags import stage_overrides
    from vllm_omni_like.pipelines.catalog import resolve as resolve_pipeline

    argv = ["serve", "tiny-omni", "--lora", "a=/m/a.safetensors", "--lora", "b=/m/b.safetensors"]
    args = build_parser().parse_args([*argv, "--lora-dir", "/m", "--max-loras", "4"])
    llm, diffusion = resolve_pipeline("tiny-omni", **stage_overrides(args))[0].stages
    assert [s.name for s in diffusion.loras] == ["a", "b"] and diffusion.lora_dir == "/m"
    assert (diffusion.max_loras, diffusion.max_lora_rank) == (4, 64)
    assert (llm.loras, llm.lora_dir) == ((), None)  # (an LLM stage in front takes none)
    yaml_file = tmp_path / "p.yaml"
    yaml_file.write_text(
        "pipelines:\n  - name: i\n    stages:\n"
        "      - name: diffusion\n        kind: diffusion\n        model: tiny-image\n"
        "        loras:\n          anime: /m/anime.safetensors\n"
        "          fast: {path: /m/fast.safetensors, steps: 4, guidance: 1.0}\n"
    )
    (stage,) = resolve_pipeline(str(yaml_file))[0].stages
    assert stage.loras == (
        LoraSpec("anime", "/m/anime.safetensors"),
        LoraSpec("fast", "/m/fast.safetensors", 4, 1.0),
    )


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"loras": ("a=/m/a.ckpt",)},
            "stage 'd': LoRA 'a': a.ckpt is a pickle file (it could run code when read): only "
            "safetensors LoRA files are read; convert it to .safetensors",
        ),
        ({"loras": ("a",)}, "stage 'd': --lora takes NAME=PATH, not 'a'"),
        (
            {"loras": ("a=/m/a.safetensors", "a=/m/b.safetensors")},
            "stage 'd': LoRA a registered twice",
        ),
        (
            {"loras": ("../a=/m/a.safetensors",)},
            "stage 'd': LoRA name '../a' must be 1-64 letters, digits, '_', '-' or '.' "
            "(not first, no '..')",
        ),
        (
            {"loras": {"a": {"path": "/m/a.safetensors", "steps": 0}}},
            "stage 'd': LoRA 'a': steps must be an integer >= 1",
        ),
        (
            {"loras": ("a=/m/a.safetensors", "b=/m/b.safetensors"), "max_loras": 1},
            "stage 'd': LoRA adapters: 2 registered but max_loras is 1",
        ),
        (
            {"lora_dir": "/m", "kind": "llm"},
            "stage 'd': LoRA adapters run on a diffusion stage, not on a 'llm' stage",
        ),
        (
            {"max_lora_rank": 0},
            "stage 'd': LoRA adapters: max_loras, max_lora_rank and max_loras_per_request must "
            "be >= 1",
        ),
        ({"lora_dir": ""}, "stage 'd': LoRA adapters: lora_dir is empty"),
    ],
)
def test_what_a_stage_cannot_take_is_refused_at_start_up(kw, message):
    kw = {"kind": "diffusion", **kw}
    with pytest.raises(ConfigError) as info:
        StageConfig(name="d", **kw)
    assert str(info.value) == message
