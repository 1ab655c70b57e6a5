"""LoRA adapters over HTTP with real worker processes: `/v1/models` lists each as
`base:adapter`, a request picks one by its `lora` list or its model, an unknown one is a 400
naming it before anything is queued, and a corrupt file fails its own request alone while the
requests beside it (and the worker) go on."""

from __future__ import annotations

import base64
import concurrent.futures
import io

import numpy as np
import pytest
from PIL import Image

from tests.api.conftest import live_server
from tests.stages.diffusion.lora_helpers import low_rank, write_peft

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import diffusers
    import torch

    from vllm_omni_like.models.tiny import ensure_tiny_model

    root = tmp_path_factory.mktemp("loras")
    unet = diffusers.UNet2DConditionModel.from_pretrained(
        ensure_tiny_model("tiny-image"), subfolder="unet", dtype=torch.float32
    )
    registered = write_peft(root / "a.safetensors", low_rank(unet, 1, 4))
    (root / "dir").mkdir()
    write_peft(root / "dir" / "good.safetensors", low_rank(unet, 2, 4))
    (root / "dir" / "corrupt.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    stage_kw = {"loras": (f"a={registered}",), "lora_dir": str(root / "dir"), "max_loras": 2}
    with live_server(tmp_path_factory, "tiny-image", stage_kw=stage_kw) as s:
        yield s


def _image(r) -> np.ndarray:
    assert r.status_code == 200, r.text
    data = base64.b64decode(r.json()["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(data))).astype(int)


def _post(http, **body):
    body = {"prompt": "a red circle", "seed": 5, "num_inference_steps": 3, **body}
    return http.post("/v1/images/generations", json=body)


def test_models_list_each_adapter_as_base_colon_adapter(server):
    with server.http() as http:
        ids = [m["id"] for m in http.get("/v1/models").json()["data"]]
        assert ids == ["tiny-image", "tiny-image:a", "tiny-image:corrupt", "tiny-image:good"]
        one = http.get("/v1/models/tiny-image:good").json()
        assert (one["parent"], one["lora"], one["output"]) == ("tiny-image", "good", "image")
        assert http.get("/v1/models/tiny-image:nope").status_code == 404


def test_a_request_picks_its_adapter_by_lora_or_by_model(server):
    with server.http() as http:
        base = _image(_post(http))
        by_list = _image(_post(http, lora=[{"name": "a", "scale": 1.0}]))
        by_model = _image(_post(http, model="tiny-image:a"))
        assert np.array_equal(by_list, by_model)
        assert np.abs(by_list - base).mean() > 1  # (the adapter changed the image)


def test_an_unknown_adapter_is_a_400_naming_it(server):
    with server.http() as http:
        for body in ({"lora": [{"name": "nope"}]}, {"model": "tiny-image:nope"}):
            r = _post(http, **body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["message"] == "unknown LoRA adapter 'nope' for model 'tiny-image'"
            assert err["code"] == "lora_not_found"
        r = _post(http, lora=[{"name": "../a"}])
        assert r.status_code == 400 and "'../a'" in r.json()["error"]["message"]


def test_more_adapters_than_a_request_may_combine_is_a_400(server):
    """`--max-loras-per-request` (4 by default): a fifth is refused at admission."""
    with server.http() as http:
        names = ["a", "good", "corrupt", "x1", "x2"]
        r = _post(http, lora=[{"name": n} for n in names])
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["message"] == (
            "a request takes at most 4 LoRA adapters (--max-loras-per-request), not 5"
        )
        assert err["param"] == "lora"


def test_a_corrupt_file_fails_its_request_alone(server):
    with server.http() as http:
        pids = [[r["pids"] for r in s["replicas"]] for s in http.get("/health").json()["stages"]]
    bodies = [{"lora": [{"name": "corrupt"}]}, {"lora": [{"name": "good"}]}, {}, {"lora": []}]
    with server.http() as http, concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda body: _post(http, **body), bodies))
    bad = answers[0]
    assert bad.status_code == 400, bad.text
    err = bad.json()["error"]
    assert err["code"] == "lora_unusable" and err["param"] == "lora"
    assert err["message"].startswith(
        "stage 'diffusion': LoRA 'corrupt': corrupt.safetensors cannot be read as safetensors: "
    )
    for r in answers[1:]:
        _image(r)
    with server.http() as http:
        health = http.get("/health").json()
        assert health["status"] == "healthy"
        now = [[r["pids"] for r in s["replicas"]] for s in health["stages"]]
        assert now == pids and health["stages"][0]["restarts"] == 0  # (no worker died)
