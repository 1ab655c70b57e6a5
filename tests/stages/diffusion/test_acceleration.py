"""Speed options of the diffusion stage, on the CPU: flags, fallbacks, compiled padded batches,
the shipped architecture configs and the random prompt embeddings of a dummy Wan."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil

import numpy as np
import pytest
import torch

from vllm_omni_like import flags
from vllm_omni_like.config import StageConfig
from vllm_omni_like.errors import ConfigError
from vllm_omni_like.models.stable_diffusion.adapter import StableDiffusionAdapter
from vllm_omni_like.models.tiny import ensure_tiny_model
from vllm_omni_like.models.wan.adapter import WanAdapter
from vllm_omni_like.parallel.branches import BatchedCFG
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.pipelines import catalog
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.diffusion import acceleration as accel
from vllm_omni_like.stages.diffusion.prompt_embeds import random_prompt_embeds
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.wire import StageRequest


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    flags.add_engine_args(parser)
    return parser.parse_args(list(argv))


def _control() -> StageControl:
    return StageControl(FaultInjector((), "diffusion"))


# ---- flags and configs -------------------------------------------------------------------
def test_speed_flags_reach_every_stage_of_the_pipeline():
    args = _args(
        "sd15",
        "--load-format=dummy",
        "--compile",
        "--compile-mode=max-autotune-no-cudagraphs",
        "--attention=xformers",
        "--channels-last=off",
        "--warmup-size=512x512",
        "--warmup-size=768x512",
        "--batch-buckets=1,8,32",
        "--batch-wait=0.2",
        "--no-batched-cfg",
        "--no-decode-overlap",
    )
    overrides = flags.stage_overrides(args)
    (pipeline,) = catalog.resolve("sd15", **overrides)
    stage = pipeline.stages[0]
    assert (stage.compile, stage.compile_mode) == (True, "max-autotune-no-cudagraphs")
    assert stage.attention == "xformers"
    assert stage.channels_last == "off" and stage.batch_wait == 0.2
    assert stage.batched_cfg is False and stage.decode_overlap is False
    assert stage.warmup_sizes == ("512x512", "768x512") and stage.batch_buckets == (1, 8, 32)
    assert stage.options.default_steps == 30  # the architecture's own defaults stay


def test_without_speed_flags_nothing_is_overridden():
    assert flags.stage_overrides(_args()) == {}
    stage = StageConfig(name="d", kind="diffusion")
    assert (stage.compile, stage.attention, stage.channels_last) == (False, "sdpa", "auto")
    assert stage.batched_cfg is True and stage.decode_overlap is True
    assert flags.stage_overrides(_args("--decode-overlap")) == {"decode_overlap": True}


@pytest.mark.parametrize(
    "argv",
    [
        ["--attention=flash"],
        ["--compile-mode=fast"],
        ["--batch-buckets=0,4"],
        ["--batch-buckets=a,b"],
        ["--channels-last=maybe"],
    ],
)
def test_bad_speed_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        _args(*argv)
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"attention": "flash"}, "attention must be one of sdpa, xformers"),
        ({"compile_mode": "fast"}, "compile_mode must be one of"),
        ({"warmup_sizes": ("512",)}, "warmup size must be 'WIDTHxHEIGHT'"),
        ({"batch_wait": 2.0}, r"batch_wait must be within \[0, 1\]"),
        ({"batch_buckets": (0,)}, "batch buckets must be >= 1"),
    ],
)
def test_stage_config_refuses_bad_speed_options(kw, message):
    with pytest.raises(ConfigError, match=message):
        StageConfig(name="d", kind="diffusion", **kw)


def test_batch_buckets():
    assert accel.buckets_for(32) == (1, 2, 4, 8, 16, 24, 32)
    assert accel.buckets_for(6) == (1, 2, 4, 6)
    assert accel.buckets_for(8, [8, 1, 8]) == (1, 8)
    assert accel.bucket_for(5, (1, 2, 4, 8)) == 8
    assert accel.bucket_for(4, (1, 2, 4, 8)) == 4
    assert accel.bucket_for(9, (1, 2, 4, 8)) == 9  # past the largest: its own shape


# ---- attention fallback --------------------------------------------------------------------
class _Pipe:
    def __init__(self) -> None:
        self.xformers_enabled = False

    def enable_xformers_memory_efficient_attention(self) -> None:
        self.xformers_enabled = True


def test_xformers_on_the_cpu_falls_back_to_sdpa_with_a_warning(caplog):
    pipe = _Pipe()
    with caplog.at_level(logging.WARNING):
        got = accel.set_attention(pipe, "xformers", torch.device("cpu"), "diffusion")
    assert got == "sdpa" and not pipe.xformers_enabled
    assert "stage diffusion: --attention xformers is not usable" in caplog.text
    assert "needs a CUDA device" in caplog.text and "falling back to PyTorch SDPA" in caplog.text


def test_xformers_that_cannot_run_its_kernels_is_not_used(caplog, monkeypatch):
    """A broken install (here: none) is found by running a kernel, not by importing."""
    monkeypatch.setitem(__import__("sys").modules, "xformers", None)  # import fails
    problem = accel.xformers_problem(torch.device("cuda"))
    assert problem is not None and problem.startswith(("ImportError", "ModuleNotFoundError"))
    pipe = _Pipe()
    with caplog.at_level(logging.WARNING):
        assert accel.set_attention(pipe, "xformers", torch.device("cuda"), "d") == "sdpa"
    assert not pipe.xformers_enabled and "falling back to PyTorch SDPA" in caplog.text


def test_sdpa_needs_no_change_and_cpu_keeps_default_kernels():
    pipe = _Pipe()
    assert accel.set_attention(pipe, "sdpa", torch.device("cpu"), "d") == "sdpa"
    adapter = StableDiffusionAdapter(pipe)
    assert accel.tune_kernels(adapter, torch.device("cpu"), "sdpa", compiled=True) == []
    assert accel.use_channels_last(adapter, "auto", torch.device("cpu"), compiled=True) is False


def test_channels_last_auto_is_for_a_compiled_unet_on_cuda():
    import diffusers

    class Conv:
        unet = torch.nn.Conv2d(4, 8, 3)
        vae = diffusers.AutoencoderKL(block_out_channels=(8,), norm_num_groups=4)

    def nhwc(module: torch.nn.Module) -> bool:
        weight = next(p for p in module.parameters() if p.dim() == 4)
        nhwc_only = not weight.is_contiguous()
        return weight.is_contiguous(memory_format=torch.channels_last) and nhwc_only

    cuda = torch.device("cuda")  # only the decision and the layout are checked: no kernel runs
    assert (
        accel.use_channels_last(StableDiffusionAdapter(Conv()), "auto", cuda, compiled=False)
        is False
    )
    assert not nhwc(Conv.unet) and not nhwc(Conv.vae)
    assert (
        accel.use_channels_last(StableDiffusionAdapter(Conv()), "off", cuda, compiled=True) is False
    )
    assert (
        accel.use_channels_last(StableDiffusionAdapter(Conv()), "auto", cuda, compiled=True) is True
    )
    assert nhwc(Conv.unet) and nhwc(Conv.vae)


# ---- shipped architectures -----------------------------------------------------------------
def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_shipped_architectures_are_the_real_models_sizes():
    import diffusers
    import transformers

    sd, wan = catalog.arch_path("sd15"), catalog.arch_path("wan2.1-t2v-1.3b")
    xl = catalog.arch_path("sdxl")
    expected = [
        (diffusers.UNet2DConditionModel, f"{sd}/unet", 859_520_964),
        (diffusers.AutoencoderKL, f"{sd}/vae", 83_653_863),
        (diffusers.UNet2DConditionModel, f"{xl}/unet", 2_567_463_684),  # SDXL 1.0 base
        (diffusers.AutoencoderKL, f"{xl}/vae", 83_653_863),
        (diffusers.WanTransformer3DModel, f"{wan}/transformer", 1_418_996_800),
        (diffusers.AutoencoderKLWan, f"{wan}/vae", 126_892_531),
    ]
    with torch.device("meta"):  # shapes only: no memory
        for cls, path, count in expected:
            assert _params(cls.from_config(cls.load_config(path))) == count, cls.__name__
        clip = transformers.CLIPTextConfig.from_pretrained(f"{sd}/text_encoder")
        assert _params(transformers.CLIPTextModel(clip)) == 123_060_480
        clip_l = transformers.CLIPTextConfig.from_pretrained(f"{xl}/text_encoder")
        assert _params(transformers.CLIPTextModel(clip_l)) == 123_060_480
        big_g = transformers.CLIPTextConfig.from_pretrained(f"{xl}/text_encoder_2")
        assert _params(transformers.CLIPTextModelWithProjection(big_g)) == 694_659_840
    with open(f"{sd}/scheduler/scheduler_config.json") as f:
        assert json.load(f)["_class_name"] == "DDIMScheduler"
    with open(f"{xl}/vae/config.json") as f:
        assert json.load(f)["force_upcast"] is True  # (its decode runs in float32)


def test_an_architecture_without_weights_needs_dummy_load():
    with pytest.raises(ConfigError, match="serve it with --load-format dummy"):
        catalog.resolve("sd15")
    (video,) = catalog.resolve("wan2.1-t2v-1.3b", load_format="dummy")
    assert video.output == "video" and video.stages[0].options.default_frames == 33


# ---- random prompt embeddings (dummy model without a text encoder) -------------------------
def test_random_prompt_embeds_are_seeded_by_the_text():
    a = random_prompt_embeds(["a cat", "a dog", "a cat"], 7, 5, torch.float16, "cpu")
    assert a.shape == (3, 7, 5) and a.dtype == torch.float16
    assert torch.equal(a[0], a[2]) and not torch.equal(a[0], a[1])
    assert torch.equal(a[1], random_prompt_embeds(["a dog"], 7, 5, torch.float16, "cpu")[0])


@pytest.fixture(scope="module")
def wan_without_text_encoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("wan") / "model"
    shutil.copytree(ensure_tiny_model("tiny-video"), path)
    with open(path / "model_index.json") as f:
        index = json.load(f)
    index.update(text_encoder=[None, None], tokenizer=[None, None])
    with open(path / "model_index.json", "w") as f:
        json.dump(index, f)
    shutil.rmtree(path / "text_encoder")
    return str(path)


@pytest.mark.slow
def test_dummy_model_without_text_encoder_runs_on_seeded_embeddings(wan_without_text_encoder):
    config = StageConfig(
        name="diffusion",
        kind="diffusion",
        model=wan_without_text_encoder,
        load_format="dummy",
        options={"max_sequence_length": 16},
    )
    stage = DiffusionStage(config)
    stage.load("cpu")
    assert stage.runtime.text.random_shape[0] == 16

    def clip(prompt: str) -> np.ndarray:
        params = GenerationParams(seed=3, num_inference_steps=2, num_frames=9, width=64, height=64)
        req = StageRequest("v", prompt, params, mode="text2video")
        return stage.execute([req], _control())[0].video.frames

    first, again, other = clip("a red circle"), clip("a red circle"), clip("a blue square")
    assert first.shape[0] == 9 and np.array_equal(first, again)
    assert not np.array_equal(first, other)
    real = DiffusionStage(StageConfig(name="d", kind="diffusion", model=wan_without_text_encoder))
    with pytest.raises(FileNotFoundError, match="has no text encoder; only --load-format dummy"):
        real.load("cpu")


def test_pyav_writes_the_same_kind_of_mp4(tmp_path):
    pytest.importorskip("av")
    from vllm_omni_like import video_codec

    frames = np.zeros((6, 32, 48, 3), np.uint8)
    frames[:, :, :24] = (200, 30, 30)
    path = os.path.join(tmp_path, "v.mp4")
    writer = video_codec.VideoWriter(path, 8, pyav=True)
    writer.append(frames[:2])  # frame by frame, as a stage streams them
    writer.append(frames[2:])
    writer.close()
    with open(path, "rb") as f:
        data = f.read()
    assert data.index(b"moov") < data.index(b"mdat")  # faststart
    back = video_codec.read_video(path)
    assert back.shape == (6, 32, 48, 3) and np.abs(back.astype(int) - frames).mean() < 4


# ---- classifier-free guidance in one forward (pipelines that call the denoiser twice) ------
class _Denoiser(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []
        self.scale = 3.0

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict=True):
        self.calls.append(hidden_states.shape[0])
        text = encoder_hidden_states.mean(dim=(1, 2)).view(-1, 1)  # row by row, as a model is
        out = hidden_states * self.scale + text + timestep.view(-1, 1)
        return (out,) if not return_dict else {"sample": out}


def test_batched_cfg_runs_both_halves_in_one_forward():
    model = _Denoiser()
    wrapper = BatchedCFG(model)
    assert wrapper.scale == 3.0  # attributes of the model show through
    latents, t = torch.randn(2, 4), torch.tensor([5.0, 5.0])
    text, negative = torch.randn(2, 3, 8), torch.zeros(2, 3, 8)

    def step():
        cond = wrapper(
            hidden_states=latents, timestep=t, encoder_hidden_states=text, return_dict=False
        )
        uncond = wrapper(
            hidden_states=latents, timestep=t, encoder_hidden_states=negative, return_dict=False
        )
        return cond[0], uncond[0]

    plain = step()
    assert model.calls == [2, 2]  # no negative set: the pipeline's two calls as they were
    wrapper.negative = negative
    batched = step()
    assert model.calls == [2, 2, 4]  # one forward over both halves
    assert all(torch.allclose(a, b) for a, b in zip(plain, batched, strict=True))
    wrapper.negative = None
    assert wrapper(hidden_states=latents, timestep=t, encoder_hidden_states=text)[
        "sample"
    ].shape == (
        2,
        4,
    )
    assert model.calls[-1] == 2


@pytest.mark.slow
def test_wan_guidance_runs_as_one_batch_with_the_same_videos():
    videos, dims = {}, {}
    for batched in (True, False):
        config = StageConfig(
            name="diffusion", kind="diffusion", model="tiny-video", batched_cfg=batched
        )
        stage = DiffusionStage(config)
        stage.load("cpu")
        reqs = [
            StageRequest(
                f"v{i}",
                prompt,
                GenerationParams(seed=i, num_inference_steps=4, num_frames=9),
                mode="text2video",
            )
            for i, prompt in enumerate(("a red circle moving left", "a blue square moving up"))
        ]
        control = _control()
        outs = stage.execute(reqs, control)
        videos[batched] = [o.video.frames.astype(int) for o in outs]
        dims[batched] = control.max_model_batch
    assert dims == {True: 4, False: 2}  # 2 requests x (conditional + unconditional) at once
    for a, b in zip(videos[True], videos[False], strict=True):
        assert np.abs(a - b).max() <= 2


def test_channels_last_auto_puts_a_video_vae_in_ndhwc_on_cuda():
    import diffusers

    def video_vae() -> torch.nn.Module:
        return diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1], num_res_blocks=1)

    def ndhwc(vae: torch.nn.Module) -> list[bool]:
        convs = [m.weight for m in vae.modules() if isinstance(m, torch.nn.Conv3d)]
        assert len(convs) > 5
        # (a 1x1x1 kernel is both layouts at once)
        return [
            w.is_contiguous(memory_format=torch.channels_last_3d)
            and (not w.is_contiguous() or w.shape[2:] == (1, 1, 1))
            for w in convs
        ]

    class Video:
        vae = video_vae()

    x = torch.randn(1, 3, 5, 16, 16)
    with torch.inference_mode():
        before = Video.vae(x).sample
    assert (
        accel.use_channels_last(WanAdapter(Video()), "auto", torch.device("cpu"), compiled=False)
        is False
    )
    assert (
        accel.use_channels_last(WanAdapter(Video()), "off", torch.device("cuda"), compiled=False)
        is False
    )
    assert not all(ndhwc(Video.vae))  # (only its 1x1x1 kernels count as both)
    assert (
        accel.use_channels_last(WanAdapter(Video()), "auto", torch.device("cuda"), compiled=False)
        is True
    )
    assert all(ndhwc(Video.vae))
    with torch.inference_mode():  # the same model: only the weights' layout changed
        assert torch.allclose(Video.vae(x).sample, before, atol=1e-5)
