"""The step cache (stages/diffusion/block_cache.py) on the tiny model of each DiT family, CPU
fp32: a threshold that never fires gives the uncached latents bit for bit; a row decides alone
(its decisions and its image are the same alone and among peers that always compute or always
reuse, <= 1 level); a row that joins a busy set starts with an empty cache; a step that raises
puts every row's cache back; the UNet family is refused at load, naming the flag."""

from __future__ import annotations

import pytest
import torch

from tests.models.tiny_mmdit import tiny_flux_path, tiny_sd3_path
from tests.models.tiny_qwen import tiny_qwen_image_path
from tests.models.tiny_wan22 import tiny_wan21_i2v_path, tiny_wan22_ti2v_path
from tests.models.tiny_z_image import tiny_z_image_path
from vllm_omni_like.config import StageConfig
from vllm_omni_like.errors import ConfigError, InvalidRequestError
from vllm_omni_like.params import GenerationParams
from vllm_omni_like.stages.diffusion.row_tensors import text_dtype
from vllm_omni_like.stages.diffusion.rows import DenoiseSet
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.wire import StageRequest

pytestmark = pytest.mark.slow
STEPS, FRAMES = 8, 5
MODELS = {
    "flux": tiny_flux_path,
    "sd3": tiny_sd3_path,
    "qwen-image": tiny_qwen_image_path,
    "z-image": tiny_z_image_path,
    "wan": lambda: "tiny-video",
    "wan-ti2v": tiny_wan22_ti2v_path,
    "wan-i2v": tiny_wan21_i2v_path,  # (rows from an image: their own conditioning)
}
THRESHOLDS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.2, 2.0)
NEVER, ALWAYS = 0.0, 1e9  # (a peer that always computes, one that reuses whenever it can)


def _stage(model: str, **config) -> DiffusionStage:
    config.setdefault("options", {"default_size": 64})  # (a real model's: slow on the CPU)
    # (these tests read sync's decisions, a step's own; lagged's, the default's, are a step
    # late: its tests below turn it on)
    config.setdefault("cache_decision", "sync")
    stage = DiffusionStage(
        StageConfig(name="diffusion", kind="diffusion", model=model, dtype="float32", **config)
    )
    stage.load("cpu")
    return stage


@pytest.fixture(scope="module", params=list(MODELS))
def cached(request):
    stage = _stage(MODELS[request.param](), cache="first-block")
    yield stage
    stage.close()


def _request(stage, rid: str, seed: int, threshold: float | None, **params) -> StageRequest:
    if stage.runtime.is_video:
        params.setdefault("num_frames", FRAMES)
    mode = "text2video" if stage.runtime.is_video else "text2img"
    p = GenerationParams(seed=seed, num_inference_steps=STEPS, cache_threshold=threshold, **params)
    if stage.runtime.family.needs_image:  # (image to video only)
        from tests.models.test_family_contract import EDIT_IMAGE

        return StageRequest(rid, "a red circle", p, mode="image2video", images=[EDIT_IMAGE])
    return StageRequest(rid, "a red circle", p, mode=mode)


class _Run:
    """A DenoiseSet driven step by step; each row's decision after every step it stepped."""

    def __init__(self, stage: DiffusionStage) -> None:
        self.rt = stage.runtime
        self.set = DenoiseSet(self.rt.denoise)
        self.decisions: dict[str, list[bool]] = {}

    def join(self, *requests: StageRequest) -> None:
        rt = self.rt
        frames = FRAMES if rt.is_video else 1
        with torch.inference_mode():
            size = (rt.defaults.width, rt.defaults.height)
            rows, embeds = rt.denoise.rows(list(requests), rt.settings(), size)
            shape = rt.adapter.latent_shape(len(rows), *size, frames)
            latents = rt.denoise.noise(rows, shape, rt.adapter.latent_dtype(text_dtype(embeds)))
            latents, conditioning = rt.denoise.conditions(rows, latents)
        self.set.join(rows, embeds, latents, conditioning)

    def step(self) -> bool:
        live = {r.request_id for r in self.set.requests}
        with torch.inference_mode():
            progress = self.set.step(live)
        for row in self.set.rows:
            if row.request.request_id in progress and row.cache is not None:
                self.decisions.setdefault(row.request.request_id, []).append(row.cache.compute)
        return bool(progress)

    def until_done(self) -> None:
        while self.step():
            pass

    def latents(self, rid: str) -> torch.Tensor:
        assert self.set.latents is not None
        (i,) = [i for i, r in enumerate(self.set.rows) if r.request.request_id == rid]
        return self.set.latents[i : i + 1].clone()


def _alone(stage, request) -> _Run:
    run = _Run(stage)
    run.join(request)
    run.until_done()
    return run


def _pixels(stage, latents: torch.Tensor) -> torch.Tensor:
    rt = stage.runtime
    with torch.inference_mode():
        pixels = rt.adapter.decoder(rt.pipe)(latents)
    return (pixels.float().clamp(0, 1) * 255).round().to(torch.int16)


def _firing(stage, seed: int) -> tuple[float, _Run]:
    """A threshold at which the row both reuses and computes after its first step."""
    for threshold in THRESHOLDS:
        run = _alone(stage, _request(stage, "a", seed, threshold))
        later = run.decisions["a"][1:]
        if any(later) and not all(later):
            return threshold, run
    pytest.fail(f"no threshold of {THRESHOLDS} both reuses and computes")


def test_a_threshold_that_never_fires_gives_the_uncached_latents_bit_for_bit(cached):
    loop = cached.runtime.denoise
    requests = [
        _request(cached, "a", 1, NEVER),
        _request(cached, "b", 2, NEVER, guidance_scale=1.0),
    ]
    evaluations, saved = loop.cache.evaluations, loop.cache.saved
    run = _Run(cached)
    run.join(*requests)
    run.until_done()
    assert loop.cache.evaluations > evaluations and loop.cache.saved == saved
    assert all(run.decisions["a"]) and all(run.decisions["b"])  # (every step computes)
    cache, loop.cache = loop.cache, None  # uncached: the wrappers only call their blocks
    try:
        plain = _Run(cached)
        plain.join(
            *[
                _request(
                    cached,
                    r.request_id,
                    r.params.seed,
                    None,
                    guidance_scale=r.params.guidance_scale,
                )
                for r in requests
            ]
        )
        plain.until_done()
    finally:
        loop.cache = cache
    assert torch.equal(run.set.latents, plain.set.latents)


def test_a_row_decides_alone_whatever_its_peers_decide(cached):
    _decides_alone(cached, first_reuse=1)


def _decides_alone(stage, first_reuse: int) -> None:
    threshold, alone = _firing(stage, seed=3)
    mixed = _Run(stage)
    mixed.join(
        _request(stage, "never", 4, NEVER),
        _request(stage, "a", 3, threshold),
        _request(stage, "always", 5, ALWAYS, guidance_scale=1.0),
    )
    mixed.until_done()
    assert mixed.decisions["a"] == alone.decisions["a"]
    always = mixed.decisions["always"]
    assert all(mixed.decisions["never"]) and all(always[:first_reuse])
    assert not any(always[first_reuse:])
    gap = (_pixels(stage, mixed.latents("a")) - _pixels(stage, alone.latents("a"))).abs()
    assert gap.max().item() <= 1


def test_a_row_that_joins_a_busy_set_starts_with_an_empty_cache(cached):
    threshold, alone = _firing(cached, seed=6)
    busy = _Run(cached)
    busy.join(_request(cached, "busy", 7, ALWAYS))
    for _ in range(3):
        busy.step()
    busy.join(_request(cached, "a", 6, threshold))
    (row,) = [r for r in busy.set.rows if r.request.request_id == "a"]
    assert row.cache is not None and row.cache.reference is None and not row.cache.rest
    busy.until_done()
    assert busy.decisions["a"] == alone.decisions["a"] and busy.decisions["a"][0]
    gap = (_pixels(cached, busy.latents("a")) - _pixels(cached, alone.latents("a"))).abs()
    assert gap.max().item() <= 1


@pytest.fixture(scope="module")
def flux():
    stage = _stage(tiny_flux_path(), cache="first-block")
    yield stage
    stage.close()


def test_a_step_that_raises_puts_every_rows_cache_back(flux):
    run = _Run(flux)
    run.join(_request(flux, "a", 1, ALWAYS), _request(flux, "b", 2, NEVER))
    run.step()
    before = [r.cache.save() for r in run.set.rows]

    def fail(requests):
        raise RuntimeError("step fault")

    with torch.inference_mode(), pytest.raises(RuntimeError, match="step fault"):
        run.set.step({"a", "b"}, fail)
    after = [r.cache.save() for r in run.set.rows]
    for (ref, rest, compute, _, steps), (ref2, rest2, compute2, _, steps2) in zip(
        before, after, strict=True
    ):
        assert ref is ref2 and compute == compute2 and steps == steps2 == 1
        assert rest.keys() == rest2.keys() and all(rest[k] is rest2[k] for k in rest)


def test_a_lagged_decision_never_fires_at_zero_and_waits_a_step_to_reuse(flux):
    cache = flux.runtime.denoise.cache
    plain = _alone(flux, _request(flux, "a", 1, NEVER))
    cache.lagged = True
    try:
        lagged = _alone(flux, _request(flux, "a", 1, NEVER))
        reusing = _alone(flux, _request(flux, "a", 1, ALWAYS))
    finally:
        cache.lagged = False
    assert torch.equal(lagged.latents("a"), plain.latents("a"))
    # its first two steps compute (the first measures nothing, the second's is read a step late)
    assert reusing.decisions["a"][:2] == [True, True] and not any(reusing.decisions["a"][2:])


def test_a_lagged_row_decides_alone_too(flux):
    """The default decision: a row's decisions and image whatever its peers decide, its first
    two steps computed."""
    cache = flux.runtime.denoise.cache
    cache.lagged = True
    try:
        _decides_alone(flux, first_reuse=2)
    finally:
        cache.lagged = False


def test_the_unet_family_is_refused_at_start_up_naming_the_flag():
    """Before anything loads: where the engine builds its stage pools, and at the load."""
    from vllm_omni_like.models.limits import describe_stage

    config = StageConfig(
        name="diffusion", kind="diffusion", model="tiny-image", cache="first-block"
    )
    wanted = r"--cache first-block runs the transformer families \(.*flux.*\), not stable-diff"
    with pytest.raises(ConfigError, match=wanted):
        describe_stage(config)
    with pytest.raises(ConfigError, match=wanted):
        _stage("tiny-image", cache="first-block")


def test_a_request_threshold_on_a_stage_without_a_cache_is_a_400():
    stage = _stage(tiny_flux_path())
    try:
        with pytest.raises(InvalidRequestError, match="runs no step cache") as caught:
            stage.validate(_request(stage, "a", 1, 0.1))
        assert caught.value.info.param == "cache"
        stage.validate(_request(stage, "b", 1, None))  # (no cache asked: fine)
    finally:
        stage.close()


def test_a_compiled_cached_set_runs_its_sub_batches_on_the_warm_ups_graphs(capfd):
    """Compiled block by block (the eager backend: real dynamo guards), buckets 1 and 4: rows
    that always compute, always reuse or decide step by step - sub-batches of 1 to 3 rows,
    padded to a bucket - compile nothing after the warm-up."""
    from torch._dynamo.utils import counters

    stage = _stage(
        tiny_flux_path(),
        cache="first-block",
        compile=True,
        max_batch_size=4,
        batch_buckets=(1, 4),
        options={"compile_backend": "eager", "default_size": 64},
    )
    try:
        assert type(stage.runtime.pipe.transformer).__name__ != "OptimizedModule"  # (blocks)
        graphs = counters["stats"]["unique_graphs"]
        capfd.readouterr()  # (the warm-up's own compiles: logged where an earlier test of the
        # process turned dynamo's recompile log on)
        run = _Run(stage)
        run.join(_request(stage, "a", 1, NEVER), _request(stage, "b", 2, ALWAYS))
        run.step()
        run.join(_request(stage, "c", 3, 0.5), _request(stage, "d", 4, ALWAYS))
        run.until_done()
        assert not any(run.decisions["b"][1:]) and all(run.decisions["a"])
        assert stage.runtime.denoise.cache.saved > 0
        assert counters["stats"]["unique_graphs"] == graphs  # nothing recompiled
        assert "Recompiling" not in capfd.readouterr().err
    finally:
        stage.close()
