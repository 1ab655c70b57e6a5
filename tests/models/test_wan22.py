"""Wan2.2 as WanPipeline ships it, on tiny models (tests/models/tiny_wan22.py): two experts
switched at the boundary timestep (T2V-A14B), a timestep per latent token (TI2V-5B, over
Wan2.2's VAE). Each keeps the family contract (the stage's video is the pipeline's at the same
seed; the adapter decodes and shapes latents as the pipeline does; the limits are what the
pipeline accepts), the adapter calls each expert as the pipeline does, and rows on both sides
of the boundary in one forward - requests of other step counts sharing a set - make what they
make alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.models import test_family_contract as contract
from tests.models.tiny_wan22 import (
    OPTIONS,
    experts_stage,
    tiny_wan22_experts_path,
    tiny_wan22_ti2v_path,
    video_frames,
    video_request,
)
from tests.stages.diffusion.test_running_set import _Harness
from vllm_omni_like.errors import InvalidRequestError
from vllm_omni_like.models.adapter import adapter_for
from vllm_omni_like.models.limits import diffusion_limits
from vllm_omni_like.models.registry import family_of

pytestmark = pytest.mark.slow
VARIANTS = {"experts": tiny_wan22_experts_path, "ti2v": tiny_wan22_ti2v_path}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def case(request) -> contract.Case:
    path = VARIANTS[request.param]()
    return contract.Case(family_of(path).name, path, path, True, False, OPTIONS)


def test_the_stage_makes_what_the_pipeline_makes(case):
    contract.test_the_stage_makes_what_its_diffusers_pipeline_makes(case)


def test_the_adapter_decodes_and_shapes_latents_as_the_pipeline_does(case):
    contract.test_the_adapter_decodes_and_shapes_latents_as_the_pipeline_does(case)


def test_the_limits_are_what_the_pipeline_accepts(case):
    contract.test_the_limits_are_what_the_pipeline_accepts(case)


def test_each_expert_is_called_as_the_pipeline_calls_it(case):
    pipe = case.pipeline()
    adapter = adapter_for(pipe, family_of(case.path))
    experts = adapter.experts()
    calls = []
    handles = [
        e.model.register_forward_hook(
            lambda m, args, kwargs, out, name=e.name: calls.append((name, kwargs, out[0])),
            with_kwargs=True,
        )
        for e in experts
    ]
    try:
        case.call(pipe, num_inference_steps=4, guidance_scale=1.0, output_type="latent")
    finally:
        for handle in handles:
            handle.remove()
    timesteps = pipe.scheduler.timesteps.tolist()
    assert len(calls) == len(timesteps)  # (no guidance: one call a step)
    if len(experts) == 2:  # the high-noise expert down to the boundary, the low-noise one after
        boundary = experts[0].boundary
        assert boundary == 0.875 * 1000
        want = ["transformer" if t >= boundary else "transformer_2" for t in timesteps]
        assert [name for name, _, _ in calls] == want and len(set(want)) == 2
        # the adapter's rule (`expert_for`, the offload's and the loop's) is the pipeline's
        assert [experts[adapter.expert_for(float(t))].name for t in timesteps] == want
    else:
        assert adapter.per_token_timesteps and calls[0][1]["timestep"].dim() == 2  # per token
    with torch.inference_mode():
        for (_, kwargs, out), t in zip(calls, timesteps, strict=True):
            latents = kwargs["hidden_states"]
            per_row = torch.full((latents.shape[0],), t)
            got = adapter.predict(latents, per_row, kwargs["encoder_hidden_states"])
            assert torch.allclose(got, out, atol=1e-6)


def test_rows_on_both_sides_of_the_boundary_in_one_forward():
    path = tiny_wan22_experts_path()
    pipe = contract.Case("wan", path, path, True, False, OPTIONS).pipeline()
    adapter = adapter_for(pipe, family_of(path))
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(2, *adapter.latent_shape(1, 64, 64, 5)[1:], generator=generator)
    text = torch.randn(2, 16, pipe.transformer.config.text_dim, generator=generator)
    timestep = torch.tensor([950.0, 400.0])  # one row each side of 875
    with torch.inference_mode():
        both = adapter.predict(latents, timestep, text)
        alone = [
            adapter.predict(latents[i : i + 1], timestep[i : i + 1], text[i : i + 1])
            for i in (0, 1)
        ]
        high = pipe.transformer(
            hidden_states=latents[:1],
            timestep=timestep[:1],
            encoder_hidden_states=text[:1],
            return_dict=False,
        )[0]
    assert torch.allclose(both, torch.cat(alone), atol=1e-5)
    assert torch.allclose(alone[0], high, atol=1e-5)  # the row above it: the high-noise expert


def test_requests_of_other_step_counts_sharing_a_set_make_what_they_make_alone():
    stage = experts_stage()
    a, b = video_request("a", 3, 6), video_request("b", 4, 3)
    # its own low-noise scale, beside a's and b's
    c = video_request("c", 5, 4, guidance_scale_2=1.5)
    alone = {}
    for r in (a, b, c):
        h = _Harness(stage)
        h.add(1, r)
        h.steps()
        alone[r.request_id] = video_frames(h.outputs, r.request_id)
    h = _Harness(stage)
    h.add(1, a)
    h.steps(2)  # a is past the boundary (its third timestep is under 875); b joins at its first
    h.add(2, b, c)
    h.steps()
    for rid, video in alone.items():
        assert np.abs(video_frames(h.outputs, rid) - video).max() <= 1, rid


# published sizes ("14B" rounds 14.29B: the tolerance is the rounding's)
PUBLISHED = {
    ("wan2.1-t2v-14b", "transformer"): 14e9,
    ("wan2.2-t2v-a14b", "transformer"): 14e9,  # the high-noise expert
    ("wan2.2-t2v-a14b", "transformer_2"): 14e9,  # the low-noise one
    ("wan2.2-ti2v-5b", "transformer"): 5e9,
    ("wan2.1-t2v-14b", "vae"): 127e6,  # Wan-VAE
    # Wan2.1-I2V-14B's: 14B and the image features' cross-attention (32.8 GB in bf16)
    ("wan2.1-i2v-14b", "transformer"): 16.4e9,
    ("wan2.1-i2v-14b", "image_encoder"): 632e6,  # CLIP ViT-H/14's vision tower
    ("wan2.2-i2v-a14b", "transformer"): 14e9,
    ("wan2.2-i2v-a14b", "transformer_2"): 14e9,
}


@pytest.mark.parametrize("arch,name", sorted(PUBLISHED))
def test_the_architectures_have_the_published_sizes(arch, name):
    from tests.models.test_mmdit import _weights

    got, want = _weights(arch, name), PUBLISHED[(arch, name)]
    assert abs(got / want - 1) < 0.025, (got, want)


def test_the_architectures_limits_are_their_published_settings():
    from vllm_omni_like.pipelines.catalog import resolve

    def limits(arch: str):
        (pipeline,) = resolve(arch, load_format="dummy")
        (stage,) = [s for s in pipeline.stages if s.kind == "diffusion"]
        return diffusion_limits(stage)

    ti2v = limits("wan2.2-ti2v-5b")  # 1280x704, 121 frames at 24 fps; 16x VAE, 2x2 patches
    assert (ti2v.default_width, ti2v.default_height, ti2v.default_frames) == (1280, 704, 121)
    assert (ti2v.size_multiple, ti2v.frame_multiple, ti2v.default_fps) == (32, 4, 24)
    for arch, steps in (("wan2.1-i2v-14b", 50), ("wan2.2-i2v-a14b", 40)):
        i2v = limits(arch)  # 720p, 81 frames at 16 fps, an image required
        assert (i2v.default_width, i2v.default_frames, i2v.default_fps) == (1280, 81, 16)
        assert (i2v.default_steps, i2v.needs_image, i2v.image_to_video) == (steps, True, True)
    assert limits("wan2.2-ti2v-5b").image_to_video and not limits("wan2.2-ti2v-5b").needs_image
    assert not limits("wan2.1-t2v-14b").image_to_video
    a14b = limits("wan2.2-t2v-a14b")  # 720p, 81 frames at 16 fps
    assert (a14b.default_width, a14b.default_height, a14b.default_frames) == (1280, 720, 81)
    assert (a14b.size_multiple, a14b.default_steps) == (16, 40)


def test_the_low_noise_expert_takes_its_own_scale():
    """`guidance_scale_2` as WanPipeline applies it: from the step the low-noise expert takes
    over; a model of one denoiser refuses it."""
    case = contract.Case("wan", *[tiny_wan22_experts_path()] * 2, True, False, OPTIONS)
    request = video_request("r", 3, 4, guidance_scale_2=2.0)
    got = contract._run(case.stage(), request)
    pipe = case.pipeline()
    want = contract._pixels(case, case.call(pipe, num_inference_steps=4, guidance_scale_2=2.0))
    assert np.abs(got.astype(int) - want.astype(int)).max() <= 1
    same = contract._pixels(case, case.call(pipe, num_inference_steps=4))
    assert np.abs(want.astype(int) - same.astype(int)).max() > 1  # (the scale counts)
    one = contract.Case("wan", *[tiny_wan22_ti2v_path()] * 2, True, False, OPTIONS).stage()
    with pytest.raises(InvalidRequestError, match="one denoiser") as exc:
        one.validate(request)
    assert exc.value.param == "guidance_scale_2"


def test_a_two_expert_model_says_where_its_experts_are(caplog):
    caplog.set_level("INFO", logger="vllm_omni_like.stages.diffusion.stage")
    experts_stage()
    said = [r.getMessage() for r in caplog.records if "two experts" in r.getMessage()]
    assert said == [
        "stage diffusion: two experts switched at timestep 875: transformer on cpu, "
        "transformer_2 on cpu (none offloaded)"
    ]
