"""bench/reference_state.py: the reference's images kept between a bench's GPU calls, one
file a model (and settings), stamped; a server part refuses another model's before starting."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from bench import reference_state
from bench.reference_state import StateMismatch

META = {"model": "sdxl", "size": 1024, "steps": 4, "guidance": 5.0, "dtype": "bf16"}


def test_the_default_path_names_the_model_and_each_override():
    sdxl = reference_state.default_path("models", "sdxl", {"size": None, "steps": None})
    flux = reference_state.default_path("models", "/models/FLUX.1 dev/", {})
    small = reference_state.default_path("models", "sdxl", {"steps": 2, "size": 512})
    assert sdxl.endswith("/models-reference-sdxl.npz")
    assert flux.endswith("/models-reference-FLUX.1_dev.npz")
    assert small.endswith("/models-reference-sdxl-size512-steps2.npz")
    assert reference_state.npz_path("/tmp/x") == "/tmp/x.npz"


def test_a_state_loads_only_for_the_model_and_settings_that_made_it(tmp_path):
    path = str(tmp_path / "state.npz")
    assert reference_state.load(path, META) is None  # (none yet: nothing to compare)
    image = np.arange(12, dtype=np.uint8).reshape(2, 2, 3)
    reference_state.save(path, {"0": image}, META)
    got = reference_state.load(path, dict(META))
    assert got is not None and list(got) == ["0"] and np.array_equal(got["0"], image)
    with pytest.raises(StateMismatch) as info:
        reference_state.load(path, {**META, "model": "flux.1-dev"})
    assert str(info.value).startswith(f"{path} holds the reference of ")
    assert "'model': 'sdxl'" in str(info.value) and "'model': 'flux.1-dev'" in str(info.value)
    with pytest.raises(StateMismatch, match="holds the reference of"):
        reference_state.load(path, {**META, "size": 512})
    np.savez(path, **{"0": image})  # (a state of before the stamp)
    with pytest.raises(StateMismatch, match="a reference state without its model's stamp"):
        reference_state.load(path, META)


def test_the_server_part_refuses_another_models_reference_before_it_starts(tmp_path, monkeypatch):
    from bench import models

    started = []
    monkeypatch.setattr(models, "Server", lambda *a, **k: started.append(a))
    path = str(tmp_path / "state.npz")
    reference_state.save(path, {"0": np.zeros((2, 2, 3), np.uint8)}, META)
    args = argparse.Namespace(state=path, state_meta={**META, "model": "z-image-turbo"})
    with pytest.raises(StateMismatch, match="holds the reference of"):
        models.part_server(args, {"size": 1024, "steps": 4, "guidance": 5.0})
    assert started == []
