"""/health, /v1/models, /version, /metrics, and the image file URLs."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from vllm_omni_like import __version__
from vllm_omni_like.errors import NotFoundError
from vllm_omni_like.media import MEDIA_TYPES
from vllm_omni_like.protocol.loras import served_adapters, split_model

router = APIRouter()
STARTED_AT = int(time.time())


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 only while every stage is ready; otherwise 503 with the reason. No API key."""
    server = request.app.state.server
    stages = server.engine.health()
    states = {s["state"] for s in stages}
    if server.start_error is not None or "dead" in states or server.engine.errored:
        status = "dead"
    elif not server.engine.started or "starting" in states:
        status = "starting"
    elif "restarting" in states:
        status = "restarting"
    else:
        status = "healthy"
    body = {"status": status, "stages": stages}
    if server.start_error is not None:
        body["error"] = server.start_error
    return JSONResponse(body, status_code=200 if status == "healthy" else 503)


def _model(engine, name: str) -> dict:
    """OpenAI's model object, with what the model makes and its limits as extension fields
    (`limits` is null for a model that makes text only: a chat model has no media limits), and
    what each stage computes in (`precision`: fp8, bf16, ...; null until a worker loaded)."""
    output = engine.pipeline_output(name)
    stages = [s for s in engine.health() if s["pipeline"] == name]
    return {
        "id": name,
        "object": "model",
        "created": STARTED_AT,
        "owned_by": "vllm_omni_like",
        "output": output,
        "stages": [s.name for s in engine.config_of(name).stages],
        "limits": engine.model_limits(name).as_dict() if output != "text" else None,
        "precision": {s["name"]: s.get("precision") for s in stages},
    }


def _adapter(engine, name: str, adapter: str) -> dict:
    """A LoRA adapter of a served model, as the model `base:adapter` (its base's fields)."""
    return {**_model(engine, name), "id": f"{name}:{adapter}", "parent": name, "lora": adapter}


def _models(engine) -> list[dict]:
    """Each served model, then each of its LoRA adapters (protocol/loras.py)."""
    found = []
    for name in engine.pipeline_names:
        found.append(_model(engine, name))
        found += [_adapter(engine, name, a) for a in served_adapters(engine, name)]
    return found


@router.get("/v1/models")
async def models(request: Request) -> dict:
    return {"object": "list", "data": _models(request.app.state.server.engine)}


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str) -> dict:
    engine = request.app.state.server.engine
    if model_id in engine.pipeline_names:
        return _model(engine, model_id)
    base, adapter = split_model(engine, model_id)
    if base in engine.pipeline_names and adapter in served_adapters(engine, str(base)):
        return _adapter(engine, str(base), str(adapter))
    raise NotFoundError(
        f"model {model_id!r} is not served here; served: {', '.join(engine.pipeline_names)}",
        param="model",
        code="model_not_found",
    )


@router.get("/version")
async def version() -> dict:
    return {"version": __version__}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(
        request.app.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8"
    )


@router.get("/v1/files/{name}")
async def image_file(request: Request, name: str) -> FileResponse:
    path = request.app.state.server.files.path(name)
    if path is None:
        raise NotFoundError("this file does not exist or has expired", code="file_not_found")
    ext = name.rsplit(".", 1)[-1]
    return FileResponse(path, media_type=MEDIA_TYPES.get(ext, "application/octet-stream"))
