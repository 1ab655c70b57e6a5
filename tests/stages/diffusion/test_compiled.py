"""Compiled diffusion stages on the CPU (torch.compile with the eager backend: real dynamo
tracing and guards, no C compiler needed): batches padded to their buckets, and a running set
that never recompiles after its warm-up."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from vllm_omni_like.config import StageConfig
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.wire import StageRequest


def _control() -> StageControl:
    return StageControl(FaultInjector((), "diffusion"))


def _image(rid: str, prompt: str, seed: int) -> StageRequest:
    return StageRequest(rid, prompt, GenerationParams(seed=seed, num_inference_steps=4))


@pytest.fixture(scope="module")
def plain_stage():
    stage = DiffusionStage(StageConfig(name="diffusion", kind="diffusion", model="tiny-image"))
    stage.load("cpu")
    return stage


def _compiled_stage(
    max_batch: int, buckets: tuple[int, ...], model: str = "tiny-image", **config
) -> DiffusionStage:
    """A tiny model compiled with the eager backend (real dynamo tracing and guards, no C
    compiler needed), loaded: its buckets compiled and warmed up."""
    stage = DiffusionStage(
        StageConfig(
            name="diffusion",
            kind="diffusion",
            model=model,
            compile=True,
            max_batch_size=max_batch,
            batch_buckets=buckets,
            options={"compile_backend": "eager"},
            **config,
        )
    )
    stage.load("cpu")
    return stage


@pytest.mark.slow
def test_compiled_stage_pads_to_its_bucket_and_matches_single_requests(plain_stage):
    """torch.compile (the eager backend here: real dynamo tracing, no C compiler needed)."""
    stage = _compiled_stage(4, (1, 4))  # compiles and warms up buckets 1 and 4
    assert stage.runtime.buckets == (1, 4)
    assert type(stage.runtime.pipe.unet).__name__ == "OptimizedModule"
    assert type(stage.runtime.pipe.vae.decoder).__name__ == "OptimizedModule"  # the image VAE's too
    colours = ("red", "blue", "green")
    reqs = [_image(f"r{i}", f"a {c} circle", seed=i) for i, c in enumerate(colours)]
    control = _control()
    outs = stage.execute(reqs, control)
    assert control.max_model_batch == 8  # 3 requests padded to 4, doubled by CFG
    assert [o.request_id for o in outs] == ["r0", "r1", "r2"]  # filler rows are dropped
    for r, out in zip(reqs, outs, strict=True):
        alone = plain_stage.execute([r], _control())[0]
        diff = np.abs(out.images[0].pixels.astype(int) - alone.images[0].pixels.astype(int))
        assert diff.max() <= 2  # batched == single for the same seed (CPU kernel rounding)
    assert np.abs(outs[0].images[0].pixels.astype(int) - outs[1].images[0].pixels).mean() > 5


@pytest.mark.slow
@pytest.mark.timeout(300)  # (its text encoders compile too: 80-130 s on two loaded cores)
def test_a_compiled_running_set_never_recompiles_after_its_warm_up(capfd):
    """Compiled (the eager backend: real dynamo guards), buckets 1, 4, 8: a set that rows join
    at other steps (their own timesteps), a row without guidance, a padded batch and decode
    groups of every size run on the warm-up's graphs - the text encoder's too (compiled with
    --compile-text-encoders on: joins of one to three prompts and their negative); only a size
    not warmed up compiles, and the worker's log says why (the guard that failed)."""
    from torch._dynamo.utils import counters

    from tests.stages.diffusion.test_running_set import _Harness, _req

    stage = _compiled_stage(8, (1, 4, 8), compile_text_encoders="on")  # (its CLIP too)
    assert type(stage.runtime.pipe.text_encoder).__name__ == "OptimizedModule"
    graphs = counters["stats"]["unique_graphs"]
    h = _Harness(stage, lanes=2, group=(3, 0.0))
    h.add(1, _req("a", 1, 6), _req("b", 2, 6, "a blue square"), _req("c", 3, 4, "a dot"))
    h.steps(2)
    h.add(2, _req("d", 4, 5, guidance_scale=1.0))  # joins at step 2, without guidance
    h.steps()
    assert sorted(h.outputs) == ["a", "b", "c", "d"] and all(
        o.error is None for o in h.outputs.values()
    )
    # two rows without guidance, joined at different steps: 2 model rows (the warm-up's size
    # for one guided image), no padding - the set's own latents go into the model as they are
    h.add(4, _req("u", 6, 4, guidance_scale=1.0))
    h.steps(1)
    h.add(5, _req("v", 7, 3, guidance_scale=1.0))
    h.steps()
    assert sorted(h.outputs) == ["a", "b", "c", "d", "u", "v"]
    assert counters["stats"]["unique_graphs"] == graphs  # nothing recompiled
    assert "Recompiling" not in capfd.readouterr().err
    h.add(3, _req("e", 5, 2, width=48, height=48))  # a size not warmed up: it compiles
    h.steps()
    assert counters["stats"]["unique_graphs"] > graphs
    err = capfd.readouterr().err
    assert "Recompiling" in err and "size mismatch" in err


@pytest.mark.slow
def test_a_compiled_cfg_parallel_split_never_recompiles_for_new_row_mixes(capfd):
    """CFG-parallel's split of our loop (rank 1's side in this process: tests/stages/
    cfg_probe.py), compiled, buckets 1 and 4: each step's unconditional forward is padded to a
    bucket as the conditional one is, so mixes of rows with and without guidance, joined at
    other steps, run on the warm-up's graphs on both sides."""
    from torch._dynamo.utils import counters

    from tests.stages.cfg_probe import local_branches
    from tests.stages.diffusion.test_running_set import _Harness, _req

    stage = _compiled_stage(4, (1, 4), batched_cfg=False)  # (CFG-parallel's rank 0 runs so)
    assert stage.runtime.denoise.buckets == (1, 4)  # (no bucket of CFG pairs: a branch a rank)
    leader = local_branches(stage)
    graphs = counters["stats"]["unique_graphs"]
    h = _Harness(stage, group=(4, 0.0))
    h.add(1, _req("a", 1, 5), _req("b", 2, 5, guidance_scale=1.0))  # 2 rows, 1 guided
    h.steps(2)
    h.add(2, _req("c", 3, 4, guidance_scale=3.0), _req("d", 4, 4, guidance_scale=9.0))
    h.steps()
    assert sorted(h.outputs) == ["a", "b", "c", "d"] and all(
        o.error is None for o in h.outputs.values()
    )
    assert leader.calls == 6  # a step each: a's 5, then c's and d's last one
    assert counters["stats"]["unique_graphs"] == graphs  # nothing recompiled
    assert "Recompiling" not in capfd.readouterr().err


@pytest.mark.slow
def test_a_compiled_flux_set_pads_rows_not_cfg_pairs_and_never_recompiles():
    """FLUX.1's guidance is embedded: a row is one model row (buckets not doubled); rows with
    their own guidance scales and steps joining a compiled set run on the warm-up's graphs."""
    from torch._dynamo.utils import counters

    from tests.models.tiny_mmdit import tiny_flux_path
    from tests.stages.diffusion.test_running_set import _Harness, _req

    stage = _compiled_stage(4, (1, 4), tiny_flux_path())
    assert stage.runtime.denoise.buckets == (1, 4)
    graphs = counters["stats"]["unique_graphs"]
    h = _Harness(stage, lanes=1, group=(2, 0.0))
    h.add(1, _req("a", 1, 4, guidance_scale=2.0), _req("b", 2, 3))
    h.steps(1)
    h.add(2, _req("c", 3, 3, guidance_scale=5.0))  # joins at step 1: 3 rows, padded to 4
    h.steps()
    assert sorted(h.outputs) == ["a", "b", "c"]
    assert all(o.error is None for o in h.outputs.values())
    assert counters["stats"]["unique_graphs"] == graphs  # nothing recompiled


@pytest.mark.slow
def test_a_compiled_ti2v_stage_runs_a_first_frame_on_its_text_rows_graph(caplog):
    """Wan2.2-TI2V's rows from a first frame and from text share our loop's forward (the same
    inputs, each row's frame mask beside them): the text rows' warm-up is theirs too, no call
    of the pipeline's is warmed up, and a request from an image compiles nothing."""
    from torch._dynamo.utils import counters

    from tests.models.test_family_contract import EDIT_IMAGE
    from tests.models.tiny_wan22 import tiny_wan22_ti2v_path

    caplog.set_level("INFO", logger="vllm_omni_like.stages.diffusion.stage")
    stage = DiffusionStage(
        StageConfig(
            name="diffusion",
            kind="diffusion",
            model=tiny_wan22_ti2v_path(),
            compile=True,
            batch_buckets=(1,),
            options={"compile_backend": "eager", "default_size": 64},
        )
    )
    stage.load("cpu")
    assert "warmed up 64x64 x1" in caplog.text and "from an image" not in caplog.text
    graphs = counters["stats"]["unique_graphs"]
    frames = stage.runtime.defaults.frames
    params = GenerationParams(seed=1, num_inference_steps=3, num_frames=frames)
    request = StageRequest("r", "x", params, mode="image2video", images=[EDIT_IMAGE])
    (out,) = stage.execute([request], _control())
    assert out.error is None and out.video.frames.shape[1:] == (64, 64, 3)
    assert counters["stats"]["unique_graphs"] == graphs  # nothing recompiled


@pytest.mark.drill  # (two image-only families compiled with their encoders: ~28 s on 2 cores)
@pytest.mark.parametrize("family", ["qwen-image-edit", "wan-i2v"])
def test_a_compiled_stage_that_only_starts_from_an_image_warms_up_from_a_blank_one(
    family, monkeypatch
):
    """Qwen-Image-Edit's instruction edits and Wan's image to video run our loop from an
    image: the warm-up starts from a blank upload of each warm-up size (an edit's upload fits
    to that aspect's sequence), so a request of that size and aspect, with and without
    guidance, compiles nothing. (Qwen-Image-Edit's uploads fit to about 128x128 here, not a
    megapixel: a CPU's speed.)"""
    from torch._dynamo.utils import counters

    from tests.models.test_family_contract import EDIT_IMAGE, case_of
    from vllm_omni_like.models.qwen_image import edit
    from vllm_omni_like.models.text_buckets import TEXT_BUCKETS

    monkeypatch.setattr(edit, "FITTED_AREA", 128 * 128)
    # (Qwen-Image's buckets only: each bucket past 512 warms up as these do, at a CPU's cost
    # for the tiny model, whose blank upload reaches them all; the warm-up's prompts for those
    # are test_qwen_image_edit.py's)
    monkeypatch.setattr(edit, "EDIT_TEXT_BUCKETS", TEXT_BUCKETS)
    case = case_of(family)
    stage = case.stage(
        compile=True, batch_buckets=(1,), options={**case.options, "compile_backend": "eager"}
    )
    graphs = counters["stats"]["unique_graphs"]
    limits = case.limits()
    size = (limits.default_width, limits.default_height)  # (64x64: a square upload's aspect)
    mode = "image2video" if case.video else "edit"
    upload = EDIT_IMAGE[:, :48]  # (48x48: a square)
    for guidance in (1.0, None):
        params = GenerationParams(seed=1, num_inference_steps=2, guidance_scale=guidance)
        params = dataclasses.replace(params, width=size[0], height=size[1])
        (out,) = stage.execute([StageRequest("r", "x", params, mode, [upload])], _control())
        assert out.error is None, out.error
    assert counters["stats"]["unique_graphs"] == graphs  # nothing recompiled
