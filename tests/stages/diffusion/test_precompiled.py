"""Precompiled forwards (stages/diffusion/precompiled.py): a restart loads each compiled shape's
forward from the compile cache with no dynamo trace and no inductor compile; an artifact of
another torch, device, stage choice or module structure is never found, one whose inlined
source changed is refused with a warning and compiled anew, and a forward that cannot be
precompiled (a graph break) runs dynamo's compile."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest
import torch

from vllm_omni_like.stages.diffusion import precompiled
from vllm_omni_like.stages.diffusion.precompiled import Precompile, Precompiled

TINY = """
import torch


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.b(torch.nn.functional.gelu(self.a(x))) + x
"""

DRIVER = """
import json, sys, torch
from torch._dynamo.utils import counters
from vllm_omni_like.stages.diffusion import precompiled
import tiny_precompiled_model as tinymod

torch.manual_seed(0)
model = tinymod.Tiny().eval()
compiled = torch.compile(model, backend="inductor", dynamic=False)
precompiled.Precompile(sys.argv[1], "salt", "diffusion").install(
    model, compiled, "inductor", "default"
)
outs = []
with torch.no_grad():
    for rows in (1, 2):  # two compiled shapes, each called twice
        for _ in range(2):
            outs.append(compiled(torch.ones(rows, 8) * rows).sum().item())
c = precompiled.COUNTS
print(json.dumps({
    "traced": counters["stats"]["unique_graphs"],
    "frames": counters["frames"]["total"],
    "compiled": counters["aot_autograd"]["total"],  # AOTAutograd and inductor runs
    "loaded": c.loaded, "saved": c.saved, "fallbacks": c.fallbacks, "outs": outs,
}))
"""


def _start(tmp_path) -> tuple[dict, str, float]:
    """One process's start over the cache: what it did, its stderr, its seconds."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache" / "inductor")}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), root])
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, str(tmp_path / "cache")],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    took = time.monotonic() - t0
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr, took


def _cold_start(tmp_path) -> tuple[dict, float]:
    """The first start over an empty cache: each shape traced, compiled and saved."""
    (tmp_path / "tiny_precompiled_model.py").write_text(TINY)
    cold, _, cold_s = _start(tmp_path)
    assert cold["saved"] == 2 and cold["loaded"] == 0 and cold["fallbacks"] == 0, cold
    assert cold["traced"] == 2 and cold["compiled"] == 2, cold
    assert len(os.listdir(tmp_path / "cache" / "precompiled")) == 2
    return cold, cold_s


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_restart_loads_every_shape_without_a_trace(tmp_path):
    cold, cold_s = _cold_start(tmp_path)
    warm, _, warm_s = _start(tmp_path)  # a restart: a fresh process over the same cache
    assert warm["loaded"] == 2 and warm["saved"] == 0 and warm["fallbacks"] == 0, warm
    # no dynamo frame converted, no graph traced, nothing through AOTAutograd and inductor
    assert warm["traced"] == 0 and warm["frames"] == 0 and warm["compiled"] == 0, warm
    assert warm["outs"] == cold["outs"]
    assert warm_s < cold_s, (warm_s, cold_s)


@pytest.mark.drill  # (two starts that compile: ~35 s on 2 cores; the restart's test above and
@pytest.mark.timeout(600)  # the artifact's key tests below run by default)
def test_a_changed_source_refuses_the_artifacts_and_compiles_anew(tmp_path):
    cold, _ = _cold_start(tmp_path)
    # the model's source changes (one line added): its artifacts are stale, refused, replaced
    (tmp_path / "tiny_precompiled_model.py").write_text(TINY + "\n# changed\n")
    again, stderr, _ = _start(tmp_path)
    assert again["loaded"] == 0 and again["saved"] == 2 and again["traced"] == 2, again
    assert "is not usable (the source of tiny_precompiled_model changed" in stderr
    assert again["outs"] == cold["outs"]


def _paths(monkeypatch, **change) -> str:
    plain = torch.nn.Linear(4, change.pop("shape", 4))
    salt = change.pop("salt", "bf16")
    if "version" in change:
        monkeypatch.setattr(torch, "__version__", change.pop("version"))
    model = torch.compile(plain, backend="eager")
    runner = Precompiled(plain, model, "/c", salt, {"backend": "inductor"}, "d")
    return runner.path(precompiled.signature((torch.ones(2, 4),), {}))


def test_an_artifact_is_found_only_under_everything_it_was_made_under(monkeypatch):
    """The path of a forward's artifact names torch's version, the device, the stage's
    choices, the module's structure and the input signature: a cache left by any other is
    never read."""
    base = _paths(monkeypatch)
    assert base == _paths(monkeypatch)  # (deterministic: a restart finds it)
    assert base.startswith("/c/precompiled/Linear-")
    others = {
        _paths(monkeypatch, salt="fp16"),
        _paths(monkeypatch, shape=5),
        _paths(monkeypatch, version="2.11.0"),
    }
    assert base not in others and len(others) == 3
    ones, twos = torch.ones(2, 4), torch.ones(3, 4)
    assert precompiled.signature((ones,), {}) != precompiled.signature((twos,), {})
    assert precompiled.signature((ones,), {}) != precompiled.signature((ones.t(),), {})


class _Breaks(torch.nn.Linear):
    def forward(self, x):
        y = super().forward(x)
        torch._dynamo.graph_break()  # (fullgraph: no one graph to precompile)
        return y * 2


def test_a_forward_that_cannot_be_precompiled_runs_dynamo_s_compile_with_one_warning(
    tmp_path, caplog
):
    """A graph break leaves no one graph to precompile: each shape falls back to dynamo's own
    compile of the module (the same outputs), one warning for the module's class, no file."""
    caplog.set_level(logging.WARNING)
    torch.manual_seed(0)
    plain = _Breaks(4, 4)
    model = torch.compile(plain, backend="eager", dynamic=False)
    before = precompiled.COUNTS.fallbacks
    precompiled.COUNTS.warned.discard("_Breaks")
    Precompile(str(tmp_path), "salt", "diffusion").install(plain, model, "eager", "default")
    with torch.no_grad():  # (as a stage runs)
        for rows in (1, 2, 2):
            x = torch.randn(rows, 4)
            torch.testing.assert_close(model(x), plain(x))
    assert precompiled.COUNTS.fallbacks == before + 2  # (one a shape; then dynamo's)
    warnings = [r.getMessage() for r in caplog.records if "precompiled" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(
        "stage diffusion: _Breaks's forward cannot be precompiled ("
    ), warnings
    assert warnings[0].endswith("it is traced at each start")
    assert not (tmp_path / "precompiled").exists() or not os.listdir(tmp_path / "precompiled")


@pytest.mark.drill
@pytest.mark.timeout(900)
def test_a_compiled_stage_s_second_load_runs_its_denoiser_precompiled(tmp_path):
    """A tiny compiled stage with a compile cache (the eager backend): its first load saves
    each denoiser shape's forward, its second loads every one (none saved, none traced: the
    warm-up compiles nothing for the UNet) and makes the same image."""
    import dataclasses

    import numpy as np

    from tests.stages.diffusion.test_compiled import _control, _image
    from vllm_omni_like.config import StageConfig
    from vllm_omni_like.stages.diffusion.stage import DiffusionStage

    config = StageConfig(
        name="diffusion",
        kind="diffusion",
        model="tiny-image",
        compile=True,
        compile_cache=str(tmp_path),
        max_batch_size=1,
        batch_buckets=(1,),
        options={"compile_backend": "eager"},
    )
    images, counts = [], []
    for _ in range(2):
        before = dataclasses.replace(precompiled.COUNTS)
        precompiled.LOADED.clear()  # (as a fresh process: nothing read yet)
        stage = DiffusionStage(config)
        stage.load("cpu")
        after = precompiled.COUNTS
        counts.append((after.saved - before.saved, after.loaded - before.loaded))
        request = _image("r", "a red circle", 3)
        images.append(stage.begin([request], _control()).finish([request])[0].images[0].pixels)
        stage.close()
    (saved, loaded), (saved_again, loaded_again) = counts
    assert saved == 2 and loaded == 0, counts  # model rows 1 and 2 (guidance): two shapes
    assert saved_again == 0 and loaded_again == 2, counts
    np.testing.assert_array_equal(images[0], images[1])


def test_an_unreadable_artifact_is_refused_with_a_warning_and_replaced(tmp_path, caplog):
    """A file that is no artifact (a torn write, another format) is a warning naming it and a
    compile whose artifact replaces it; the next process loads that one."""
    caplog.set_level(logging.WARNING)
    plain = torch.nn.Linear(4, 4)
    model = torch.compile(plain, backend="eager", dynamic=False)
    Precompile(str(tmp_path), "salt", "diffusion").install(plain, model, "eager", "default")
    x = torch.randn(2, 4)
    with torch.no_grad():  # (as the forward sees it)
        path = model.forward.path(precompiled.signature((x,), {}))
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(b"not an artifact")
    saved = precompiled.COUNTS.saved
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x))
    (warning,) = [r.getMessage() for r in caplog.records if "precompiled" in r.getMessage()]
    assert warning.startswith(
        f"stage diffusion: the precompiled forward {os.path.basename(path)} is not usable ("
    )
    assert precompiled.COUNTS.saved == saved + 1 and os.path.getsize(path) > 100
    precompiled.LOADED.clear()  # (as a fresh process)
    again = torch.compile(plain, backend="eager", dynamic=False)
    Precompile(str(tmp_path), "salt", "diffusion").install(plain, again, "eager", "default")
    loaded = precompiled.COUNTS.loaded
    with torch.no_grad():
        torch.testing.assert_close(again(x), plain(x))
    assert precompiled.COUNTS.loaded == loaded + 1


def test_an_artifact_that_cannot_be_saved_still_runs_in_its_process(tmp_path, caplog):
    """The cache's directory cannot be made (a file in its place): the forward compiled ahead
    of time runs in this process, one warning says it will be traced at each start."""
    caplog.set_level(logging.WARNING)
    (tmp_path / "precompiled").write_text("a file, not a directory")
    plain = torch.nn.Linear(4, 3)
    model = torch.compile(plain, backend="eager", dynamic=False)
    precompiled.COUNTS.warned.discard("Linear")
    Precompile(str(tmp_path), "salt", "diffusion").install(plain, model, "eager", "default")
    x = torch.randn(2, 4)
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x))
        torch.testing.assert_close(model(x), plain(x))
        assert model.forward.fns[precompiled.signature((x,), {})] is not None  # (not dynamo's)
    (warning,) = [r.getMessage() for r in caplog.records if "precompiled" in r.getMessage()]
    assert warning.startswith("stage diffusion: Linear's forward cannot be precompiled (")
    assert warning.endswith("it is traced at each start")
    assert os.listdir(tmp_path) == ["precompiled"]  # (no temporary file left)


def test_a_torch_whose_compiled_functions_have_no_aot_compile_precompiles_nothing(
    monkeypatch, caplog
):
    """A torch whose compiled functions lack `aot_compile` (as 2.11's did with the API switched
    off, before `available` switched it on): the stage says so once and traces as before,
    instead of warning for every forward at every start."""
    from vllm_omni_like.config import StageConfig

    config = StageConfig(
        name="diffusion", kind="diffusion", model="tiny-image", compile=True, compile_cache="/x"
    )
    assert precompiled.available()  # (this torch: 2.13)
    assert precompiled.for_stage(config, "inductor") is not None

    def without_aot(fn, **_):  # what torch 2.11's torch.compile of a function gives
        return lambda *a, **k: fn(*a, **k)

    monkeypatch.setattr(torch, "compile", without_aot)
    assert not precompiled.available()
    with caplog.at_level(logging.INFO, logger="vllm_omni_like.stages.diffusion.stage"):
        assert precompiled.for_stage(config, "inductor") is None
    said = [r.getMessage() for r in caplog.records if "cannot precompile" in r.getMessage()]
    assert said == [
        f"stage diffusion: torch {torch.__version__} cannot precompile forwards (no "
        "aot_compile): they are traced at each start, their compiled graphs read from the "
        "compile cache"
    ]


def test_a_torch_whose_aot_compile_is_switched_off_gets_it_switched_on(monkeypatch):
    """torch 2.11 gives compiled functions `aot_compile` only while dynamo's
    `enable_aot_compile` is on, off by default there (2.13: on, the same gate): `available`
    turns it on, so the stage's compile that follows can precompile."""
    import torch._dynamo.config as dynamo_config

    monkeypatch.setattr(dynamo_config, "enable_aot_compile", False)
    assert not hasattr(torch.compile(lambda x: x), "aot_compile")  # (as on torch 2.11)
    assert precompiled.available()
    assert dynamo_config.enable_aot_compile is True
    assert hasattr(torch.compile(lambda x: x), "aot_compile")
