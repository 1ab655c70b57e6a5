"""Many LoRA adapters in one batch (stages/diffusion/lora_*.py) on the embedded tiny image model,
CPU fp32: a batch mixing two adapters and the base gives each row its solo image, scale 0 is the
base, a row equals diffusers' `load_lora_weights` + `fuse_lora` at the same seed (peft and kohya
files), a lightning adapter's steps apply to its rows only, and the pool's slots are held,
evicted least recently used and written in place."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.stages.diffusion.lora_helpers import low_rank, write_kohya, write_peft
from vllm_omni_like.config import StageConfig
from vllm_omni_like.errors import ConfigError, InvalidRequestError, UnavailableError
from vllm_omni_like.models.tiny import ensure_tiny_model
from vllm_omni_like.params import GenerationParams, LoraRef
from vllm_omni_like.stages.base import StageControl
from vllm_omni_like.stages.diffusion.stage import DiffusionStage
from vllm_omni_like.stages.faults import FaultInjector
from vllm_omni_like.wire import StageRequest

pytestmark = pytest.mark.slow
STEPS = 3


def _pipe():
    import diffusers

    path = ensure_tiny_model("tiny-image")
    pipe = diffusers.DiffusionPipeline.from_pretrained(
        path, local_files_only=True, dtype=torch.float32
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    unet = _pipe().unet
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


@pytest.fixture(scope="module")
def stage(files):
    loras = tuple(f"{n}={files[n]}" for n in ("a", "b", "kohya"))
    s = _lora_stage("tiny-image", loras, 8, lora_dir=files["dir"], max_loras=4)
    yield s
    s.close()


def _lora_stage(model: str, loras, max_lora_rank: int, **kw) -> DiffusionStage:
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


def _req(rid: str, loras=(), seed: int = 3, **params) -> StageRequest:
    params.setdefault("num_inference_steps", STEPS)
    p = GenerationParams(seed=seed, loras=tuple(loras), **params)
    return StageRequest(rid, "a red circle", p, mode="text2img")


def _run(stage: DiffusionStage, batch: list[StageRequest]) -> dict[str, np.ndarray]:
    for r in batch:
        stage.validate(r)
    control = StageControl(FaultInjector((), "diffusion"), None)
    outs = stage.begin(batch, control).finish(batch)
    return {o.request_id: np.stack([i.pixels for i in o.images]).astype(int) for o in outs}


def _pipeline_image(pipe, stage: DiffusionStage, seed: int) -> np.ndarray:
    """The diffusers pipeline's image of the stage's request (its prompt, steps and defaults)."""
    rt = stage.runtime
    with torch.inference_mode():
        out = pipe(
            "a red circle",
            num_inference_steps=STEPS,
            guidance_scale=rt.defaults.guidance,
            generator=torch.Generator().manual_seed(seed),
            width=rt.defaults.width,
            height=rt.defaults.height,
            output_type="np",
        )
    return (out.images[0] * 255).round().astype(int)


A, B = (LoraRef("a"),), (LoraRef("b", 0.8),)


def test_a_batch_mixing_two_adapters_and_the_base_gives_each_row_its_solo_image(stage):
    batch = [
        _req("base"),
        _req("a", A),
        _req("b", B, seed=4, guidance_scale=1.0),  # (a row without guidance beside CFG rows)
        _req("ab", A + B, seed=5),
    ]
    together = _run(stage, batch)
    for r in batch:
        alone = _run(stage, [r])[r.request_id]
        assert np.abs(alone - together[r.request_id]).max() <= 1, r.request_id
    base = _run(stage, [_req("a", seed=3)])["a"]
    assert np.abs(together["a"] - base).mean() > 5  # (the adapter does something)
    assert stage.runtime.denoise.loras is not None and not stage.runtime.denoise.loras.pins


def test_scale_zero_is_the_base(stage):
    out = _run(stage, [_req("base"), _req("zero", (LoraRef("b", 0.0),))])
    assert np.abs(out["base"] - out["zero"]).max() == 0


def _psnr(x: np.ndarray, y: np.ndarray) -> float:
    mse = float(((x.astype(float) - y.astype(float)) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


@pytest.mark.parametrize(("name", "scale"), [("b", 0.8), ("kohya", 1.0)])
def test_a_row_equals_diffusers_load_lora_weights_and_fuse_lora(stage, files, name, scale):
    ours = _run(stage, [_req("x", (LoraRef(name, scale),), seed=11)])["x"][0]
    pipe = _pipe()
    pipe.load_lora_weights(files[name])
    pipe.fuse_lora(lora_scale=scale)
    theirs = _pipeline_image(pipe, stage, 11)
    assert _psnr(ours, theirs) >= 35


def test_three_adapters_in_one_request_equal_diffusers_set_adapters_and_fuse(stage, files):
    """More than two adapters a row (`--max-loras-per-request`, 4 by default): three at their
    scales equal diffusers' load_lora_weights of each, set_adapters with those weights and
    fuse_lora, at the same seed; a fifth is refused by the stage too."""
    scales = {"a": 1.0, "b": 0.8, "kohya": 0.5}
    refs = tuple(LoraRef(n, s) for n, s in scales.items())
    ours = _run(stage, [_req("x", refs, seed=12), _req("base", seed=12)])
    pipe = _pipe()
    import warnings

    with warnings.catch_warnings():  # (peft: "multiple adapters in the model", as asked)
        warnings.simplefilter("ignore", UserWarning)
        for name in scales:
            pipe.load_lora_weights(files[name], adapter_name=name)
    pipe.set_adapters(list(scales), adapter_weights=list(scales.values()))
    pipe.fuse_lora(adapter_names=list(scales))
    theirs = _pipeline_image(pipe, stage, 12)
    assert _psnr(ours["x"][0], theirs) >= 35
    assert _psnr(ours["base"][0], theirs) < 30  # (the three adapters do something)
    five = tuple(LoraRef(n) for n in ("a", "b", "kohya", "c", "fast"))
    with pytest.raises(InvalidRequestError) as info:
        stage.validate(_req("y", five))
    assert str(info.value) == "at most 4 LoRA adapters a request (--max-loras-per-request)"


def test_a_lightning_adapter_runs_its_steps_and_guidance_on_its_rows_only(stage):
    rt = stage.runtime
    with torch.inference_mode():
        rows, _ = rt.denoise.rows(
            [
                _req("fast", (LoraRef("fast"),), num_inference_steps=None),
                _req("plain", num_inference_steps=None),
                _req("asked", (LoraRef("fast"),), num_inference_steps=3),
            ],
            rt.settings(),
        )
    steps = [r.state.schedule.iterations for r in rows]
    assert steps == [2, rt.defaults.steps, 3]
    assert [r.guidance for r in rows] == [1.0, rt.defaults.guidance, 1.0]
    assert rows[1].cfg and not rows[0].cfg


def test_the_pool_evicts_the_least_recently_used_idle_adapter_never_a_held_one(stage):
    pool = stage.runtime.denoise.loras
    assert pool is not None
    held = [pool.acquire((LoraRef(n),)) for n in ("a", "b", "kohya", "c")]  # 4 slots: full
    with pytest.raises(UnavailableError, match="all 4 LoRA slots"):
        pool.acquire((LoraRef("fast"),))
    assert not pool.pins.get(0) and sum(pool.pins.values()) == 4  # (the failed one holds none)
    pool.release(held[1])  # b is idle now: the one evicted
    loads = pool.loads
    fast = pool.acquire((LoraRef("fast"),))
    assert pool.loads == loads + 1 and "b" not in pool.slots and fast[0][0] == held[1][0][0]
    for selection in [held[0], held[2], held[3], fast]:
        pool.release(selection)
    assert not pool.pins
    again = pool.acquire((LoraRef("a"),))  # resident: no write
    assert pool.loads == loads + 1
    assert not pool.evict("a")  # (held by a row)
    pool.release(again)
    assert pool.evict("a") and "a" not in pool.slots and not pool.evict("a")
    pool.release(pool.acquire((LoraRef("a"),)))  # (written again into the freed slot)
    assert pool.loads == loads + 2


def test_a_request_naming_an_unknown_or_broken_adapter_fails_validation_alone(stage, files):
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'nope'"):
        stage.validate(_req("x", (LoraRef("nope"),)))
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter"):
        stage.validate(_req("x", (LoraRef("../a"),)))
    broken = f"{files['dir']}/broken.safetensors"
    with open(broken, "wb") as f:
        f.write(b"\x00" * 40)
    try:
        with pytest.raises(InvalidRequestError, match=r"broken\.safetensors cannot be read") as e:
            _verdict(stage, _req("x", (LoraRef("broken"),)))
        assert e.value.code == "lora_unusable"
    finally:
        import os

        os.remove(broken)


def _verdict(stage: DiffusionStage, request: StageRequest) -> None:
    """Validation once the request's adapter files are read (its first validation starts the
    reads, off this thread, and judges only those already done)."""
    import contextlib

    with contextlib.suppress(InvalidRequestError):
        stage.validate(request)
    _wait_read(stage.runtime.denoise.loras, request.params.loras)
    stage.validate(request)


def test_a_malformed_adapter_is_its_requests_400_and_the_worker_stays(stage, files):
    """Metadata that is not JSON (or a converter's own error) is the request's 400, not an
    exception out of the worker's validation (which would kill the worker)."""
    unet = _pipe().unet
    bad = write_peft(
        f"{files['dir']}/bad.safetensors",
        low_rank(unet, 6, 2),
        meta={"lora_adapter_metadata": "{not json"},
    )
    try:
        with pytest.raises(InvalidRequestError, match=r"'bad': unreadable \(JSONDecodeError") as e:
            _verdict(stage, _req("x", (LoraRef("bad"),)))
        assert e.value.code == "lora_unusable"
    finally:
        import os

        os.remove(bad)
    assert _run(stage, [_req("y", A)])["y"].shape[0] == 1  # (the stage serves on)


def test_more_adapters_than_the_pool_holds_is_a_400_not_a_retry(stage):
    small = stage.runtime.denoise.loras
    assert small is not None
    max_loras, small.max_loras = small.max_loras, 1
    try:
        with pytest.raises(InvalidRequestError, match=r"pool holds 1 \(--max-loras\)"):
            stage.validate(_req("x", (LoraRef("a"), LoraRef("b"))))
    finally:
        small.max_loras = max_loras


def test_a_join_that_fails_after_taking_its_slots_lets_them_go(stage, monkeypatch):
    from vllm_omni_like.stages.diffusion import rows as rows_module

    pool = stage.runtime.denoise.loras
    assert pool is not None
    real = rows_module.cat_rows
    calls = []

    def out_of_memory(*args):
        calls.append(1)
        raise torch.OutOfMemoryError("injected at the join")

    from vllm_omni_like.stages.diffusion.running_set import OwnLoopSet

    control = StageControl(FaultInjector((), "diffusion"), None)
    running = OwnLoopSet(stage.runtime)
    running.join([_req("x", A)], control)  # (x holds a's slot while it runs)
    held = dict(pool.pins)
    monkeypatch.setattr(rows_module, "cat_rows", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):  # (a group joining a running set: concatenated)
        running.join([_req("y", B)], control)
    monkeypatch.setattr(rows_module, "cat_rows", real)
    assert calls and dict(pool.pins) == held  # y's slot for b let go; x's kept
    running.set.let_go()
    running.drained()
    assert not pool.pins


def test_a_registered_adapter_the_base_cannot_take_refuses_the_start(tmp_path):
    unet = _pipe().unet
    bad = low_rank(unet, 1, 4, ends=("time_embedding.linear_1",))
    path = write_peft(tmp_path / "bad.safetensors", bad)
    loras = (f"t={path}",)
    config = StageConfig(
        name="diffusion", kind="diffusion", model="tiny-image", dtype="float32", loras=loras
    )
    s = DiffusionStage(config)
    with pytest.raises(ConfigError, match=r"time_embedding\.linear_1 is not an attention or MLP"):
        s.load("cpu")


def test_a_video_model_mixes_adapters_in_one_batch_too(tmp_path):
    """Wan (tiny-video): its converter returns no alphas; a row equals its solo video."""
    import diffusers

    path = ensure_tiny_model("tiny-video")
    model = diffusers.WanTransformer3DModel.from_pretrained(
        path, subfolder="transformer", dtype=torch.float32
    )
    ends = ("attn1.to_q", "attn2.to_v", "ffn.net.2")
    weights = low_rank(model, 1, 4, ends=ends, std=0.5)
    file = write_peft(tmp_path / "v.safetensors", weights, prefix="transformer")
    video = _lora_stage("tiny-video", (f"v={file}",), 4)
    try:

        def req(rid: str, loras=()) -> StageRequest:
            p = GenerationParams(seed=1, num_inference_steps=2, num_frames=5, loras=loras)
            return StageRequest(rid, "a red circle moving right", p, mode="text2video")

        def run(batch):
            control = StageControl(FaultInjector((), "diffusion"), None)
            outs = video.begin(batch, control).finish(batch)
            return {o.request_id: o.video.frames.astype(int) for o in outs}

        batch = [req("base"), req("v", (LoraRef("v"),))]
        together = run(batch)
        for r in batch:
            assert np.abs(run([r])[r.request_id] - together[r.request_id]).max() <= 1
        assert np.abs(together["v"] - together["base"]).mean() > 5
    finally:
        video.close()


def test_a_join_that_finds_every_slot_held_fails_and_holds_nothing(stage):
    pool = stage.runtime.denoise.loras
    assert pool is not None
    held = [pool.acquire((LoraRef(n),)) for n in ("a", "b", "kohya", "c")]
    try:
        before = dict(pool.pins)
        batch = [_req("x", (LoraRef("a"),)), _req("y", (LoraRef("fast"),))]
        with pytest.raises(UnavailableError) as info:
            _run(stage, batch)
        assert info.value.code == "lora_pool_full"
        assert str(info.value) == (
            "all 4 LoRA slots (--max-loras) are held by running requests; 'fast' cannot be "
            "loaded now: retry"
        )
        assert dict(pool.pins) == before  # (x's hold on a was let go with the failed join)
    finally:
        for selection in held:
            pool.release(selection)
    assert not pool.pins


def test_a_mode_our_loop_does_not_run_or_a_stage_without_a_pool_refuses_a_lora(stage):
    rt, own = stage.runtime, stage.runtime.own
    rt.own = set()  # (as if the pipeline's call ran every mode)
    try:
        with pytest.raises(InvalidRequestError) as info:
            stage.validate(_req("x", A))
        assert str(info.value) == (
            "LoRA adapters run on our own loop; this model's text2img runs the pipeline's call"
        )
    finally:
        rt.own = own
    pool, rt.denoise.loras = rt.denoise.loras, None
    try:
        with pytest.raises(InvalidRequestError) as info:
            stage.validate(_req("x", A))
        assert str(info.value) == "this model serves no LoRA adapters (--lora, --lora-dir)"
    finally:
        rt.denoise.loras = pool


def test_both_branches_in_two_forwards_take_the_rows_adapters(files):
    loras = (f"b={files['b']}",)
    two = _lora_stage("tiny-image", loras, 8, batched_cfg=False)
    try:
        batch = [_req("base"), _req("b", B, seed=4)]
        split = _run(two, batch)
    finally:
        two.close()
    alone = _run_one_forward(files, batch)
    for r in batch:
        assert np.abs(split[r.request_id] - alone[r.request_id]).max() <= 1, r.request_id


def _run_one_forward(files, batch):
    one = _lora_stage("tiny-image", (f"b={files['b']}",), 8)
    try:
        return _run(one, batch)
    finally:
        one.close()


def test_a_file_broken_after_its_validation_fails_its_join_alone(stage, files):
    import os
    import shutil

    path = os.path.join(files["dir"], "later.safetensors")
    shutil.copy(files["c"], path)
    try:
        request = _req("x", (LoraRef("later"),))
        stage.validate(request)  # (read and checked: fine)
        with open(path, "wb") as f:
            f.write(b"\x00" * 16)  # (then the file changes under it)
        control = StageControl(FaultInjector((), "diffusion"), None)
        with pytest.raises(InvalidRequestError) as info:
            stage.begin([request], control)
        assert info.value.code == "lora_unusable"
        assert str(info.value).startswith("LoRA 'later': later.safetensors cannot be read")
        assert not stage.runtime.denoise.loras.pins
    finally:
        os.remove(path)


def _expert_files(tmp_path) -> dict[str, str]:
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
    import safetensors.torch

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


def _video_req(rid: str, loras=(), seed: int = 1) -> StageRequest:
    p = GenerationParams(
        seed=seed,
        num_inference_steps=2,
        num_frames=5,
        guidance_scale=4.0,
        loras=loras,
        width=64,
        height=64,
    )
    return StageRequest(rid, "a red circle moving right", p, mode="text2video")


def _videos(stage: DiffusionStage, batch: list[StageRequest]) -> dict[str, np.ndarray]:
    for r in batch:
        stage.validate(r)
    control = StageControl(FaultInjector((), "diffusion"), None)
    outs = stage.begin(batch, control).finish(batch)
    return {o.request_id: o.video.frames.astype(int) for o in outs}


def test_two_experts_take_an_adapter_as_diffusers_loads_it_into_both(tmp_path):
    """Wan2.2-A14B's shape: one pool over both experts' layers; a file's `transformer.` keys in
    both, or its `transformer_2.` keys in the second; each row equals diffusers' loads of the
    same into each expert + fuse_lora at the same seed, in one batch beside the base (two
    steps: one of each expert)."""
    import diffusers

    from tests.models.tiny_wan22 import tiny_wan22_experts_path

    files = _expert_files(tmp_path)
    path = tiny_wan22_experts_path()
    stage = _lora_stage(path, (f"both={files['both']}", f"each={files['each']}"), 4)
    try:
        batch = [
            _video_req("both", (LoraRef("both"),)),
            _video_req("base"),
            _video_req("each", (LoraRef("each", 0.8),)),
        ]
        together = _videos(stage, batch)
    finally:
        stage.close()
    for name, loads, scale in (
        ("both", ((files["both"], False), (files["both"], True)), 1.0),
        ("each", ((files["1"], False), (_renamed(files["2"]), True)), 0.8),
    ):
        pipe = diffusers.WanPipeline.from_pretrained(
            path, local_files_only=True, dtype=torch.float32
        )
        pipe.set_progress_bar_config(disable=True)
        for file, second in loads:
            pipe.load_lora_weights(file, load_into_transformer_2=second)
        pipe.fuse_lora(components=["transformer", "transformer_2"], lora_scale=scale)
        with torch.inference_mode():
            out = pipe(
                "a red circle moving right",
                max_sequence_length=pipe.tokenizer.model_max_length,  # (the stage's text)
                num_inference_steps=2,
                num_frames=5,
                guidance_scale=4.0,
                width=64,
                height=64,
                generator=torch.Generator().manual_seed(1),
                output_type="np",
            )
        theirs = (out.frames[0] * 255).round().astype(int)
        assert _psnr(together[name], theirs) >= 35, name
    assert np.abs(together["both"] - together["base"]).mean() > 5


def _renamed(path: str) -> dict[str, torch.Tensor]:
    """A `transformer_2.` file's keys as `transformer.` (diffusers loads a second expert's
    adapter from those, with load_into_transformer_2)."""
    import safetensors.torch

    tensors = safetensors.torch.load_file(path)
    return {k.replace("transformer_2.", "transformer.", 1): v for k, v in tensors.items()}


def test_a_resident_adapter_whose_file_changed_is_written_again_for_the_next_request(stage, files):
    """A --lora-dir file changed on disk (size, mtime): the next request that names it gets it
    read and written again, into another slot while a running row holds the old one (which is
    freed when that row lets go)."""
    import os

    pool = stage.runtime.denoise.loras
    assert pool is not None
    path = os.path.join(files["dir"], "swap.safetensors")
    unet = _pipe().unet
    write_peft(path, low_rank(unet, 7, 2))
    try:
        before = _run(stage, [_req("x", (LoraRef("swap"),), seed=9)])["x"]
        held = pool.acquire((LoraRef("swap"),))  # (a running row holds the first version)
        loads = pool.loads
        write_peft(path, low_rank(unet, 8, 4))  # (another rank: another size)
        again = pool.acquire((LoraRef("swap"),))
        assert pool.loads == loads + 1 and again[0][0] != held[0][0]
        assert held[0][0] not in pool.free  # (still held)
        pool.release(held)
        assert held[0][0] in pool.free and not pool.stale  # (freed once let go)
        pool.release(again)
        after = _run(stage, [_req("x", (LoraRef("swap"),), seed=9)])["x"]
        assert pool.loads == loads + 1  # (resident now: not written a third time)
        assert np.abs(after - before).mean() > 1  # (the new file's weights)
    finally:
        os.remove(path)
        pool.evict("swap")


def _gated(pool, monkeypatch):
    """The pool's reads wait for the returned event before reading (a slow disk)."""
    import threading

    gate, real = threading.Event(), pool.reads.read
    monkeypatch.setattr(pool.reads, "read", lambda spec: (gate.wait(60), real(spec))[1])
    return gate


def _wait_read(pool, refs) -> None:
    import time

    deadline = time.monotonic() + 60
    while not pool.ready(refs):
        assert time.monotonic() < deadline, "the read did not end within 60 s"
        pool.wait(refs, 0.5)


def test_a_slow_read_does_not_stall_the_running_rows(stage, files, monkeypatch):
    """A request whose --lora-dir file is still being read waits in the running set while the
    rows already in it step (each step bounded); it joins at the boundary after its read."""
    import shutil
    import time

    from vllm_omni_like.stages.diffusion.running_set import OwnLoopSet

    pool = stage.runtime.denoise.loras
    assert pool is not None
    path = f"{files['dir']}/slow.safetensors"
    shutil.copy(files["c"], path)
    gate = _gated(pool, monkeypatch)
    control = StageControl(FaultInjector((), "diffusion"), None)
    running = OwnLoopSet(stage.runtime, defer_reads=True)
    try:
        running.join([_req("x", num_inference_steps=6)], control)
        slow = _req("y", (LoraRef("slow"),), num_inference_steps=2)
        stage.validate(slow)  # (starts its read, which waits for the gate)
        running.join([slow], control)
        assert [r.request_id for r in running.stepping] == ["x"] and running.pending == [slow]
        for _ in range(3):  # the running row steps meanwhile
            started = time.monotonic()
            assert running.step(control, {"x", "y"}) and running.leave(control) is None
            assert time.monotonic() - started < 10
        assert not pool.ready(slow.params.loras)
        gate.set()
        _wait_read(pool, slow.params.loras)
        assert running.leave(control) is None and not running.pending  # (joined at it)
        assert [r.request_id for r in running.stepping] == ["x", "y"]
        parts = []
        for _ in range(10):
            if not running.requests:
                break
            running.step(control, {"x", "y"})
            if (part := running.leave(control)) is not None:
                parts.append(part)
        outs = [o for p in parts for o in p.finish(p.requests)]
        assert sorted(o.request_id for o in outs) == ["x", "y"]
        assert all(o.error is None for o in outs)
    finally:
        gate.set()
        running.set.let_go()
        shutil.os.remove(path)
    assert not pool.pins


def test_a_corrupt_file_read_while_its_request_waits_fails_that_request_alone(
    stage, files, monkeypatch
):
    from vllm_omni_like.stages.diffusion.running_set import OwnLoopSet

    pool = stage.runtime.denoise.loras
    assert pool is not None
    path = f"{files['dir']}/rotten.safetensors"
    with open(path, "wb") as f:
        f.write(b"\x00" * 40)
    gate = _gated(pool, monkeypatch)
    control = StageControl(FaultInjector((), "diffusion"), None)
    running = OwnLoopSet(stage.runtime, defer_reads=True)
    try:
        running.join([_req("x", num_inference_steps=4)], control)
        bad = _req("y", (LoraRef("rotten"),))
        stage.validate(bad)  # (its read is under way: no verdict yet)
        running.join([bad], control)
        gate.set()
        _wait_read(pool, bad.params.loras)
        assert running.step(control, {"x", "y"})
        part = running.leave(control)
        assert part is not None and [r.request_id for r in part.requests] == ["y"]
        (out,) = part.finish(part.requests)
        assert out.error is not None and out.error.code == "lora_unusable"
        assert out.error.message.startswith(
            "stage 'diffusion': LoRA 'rotten': rotten.safetensors cannot be read as safetensors"
        )
        assert [r.request_id for r in running.requests] == ["x"]  # (x steps on)
        with pytest.raises(InvalidRequestError) as info:  # (its verdict is kept: now at once)
            stage.validate(_req("z", (LoraRef("rotten"),)))
        assert info.value.code == "lora_unusable"
    finally:
        gate.set()
        running.set.let_go()
        import os

        os.remove(path)
    assert not pool.pins
