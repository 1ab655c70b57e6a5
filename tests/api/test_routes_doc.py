"""docs/api.md's route table is the app's: every route the server answers is in it, and every
route it lists is served (the flags' twin is tests/test_cli_help.py against docs/cli.md)."""

from __future__ import annotations

import re
from pathlib import Path

from fastapi.routing import APIRoute

from vllm_omni_like.api.app import create_app
from vllm_omni_like.config import EngineConfig, ServerSettings
from vllm_omni_like.engine import AsyncOmni
from vllm_omni_like.pipelines.catalog import resolve

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def _normal(path: str) -> str:
    return re.sub(r"\{\w+(:\w+)?\}", "{}", path)  # {video_id}, {id}, {model_id:path}: a slot


def _served(tmp_path) -> tuple[set[str], set[str]]:
    """(the documented-API routes, the page's static files) as 'METHOD /path'."""
    engine = AsyncOmni(EngineConfig(pipelines=tuple(resolve("null-image"))))  # never started
    app = create_app(engine, ServerSettings(storage_dir=str(tmp_path)))
    api, static = set(), set()
    for route in _routes(app.routes):
        for method in route.methods - {"HEAD"}:
            (api if route.include_in_schema else static).add(f"{method} {_normal(route.path)}")
    return api, static


def _routes(routes: list) -> list[APIRoute]:
    """The app's routes, through the routers it includes (FastAPI wraps each included one)."""
    found = []
    for route in routes:
        if isinstance(route, APIRoute):
            found.append(route)
        elif hasattr(route, "original_router"):
            found += _routes(route.original_router.routes)
    return found


def _documented() -> set[str]:
    rows = [line for line in DOC.read_text().splitlines() if line.startswith("| `")]
    found = set()
    for row in rows:
        first = row.split("|")[1]
        for method, path in re.findall(r"`(GET|POST|DELETE|PUT|PATCH) ([^`]+)`", first):
            found.add(f"{method} {_normal(path)}")
    return found


def test_every_route_is_documented_and_every_documented_route_is_served(tmp_path):
    api, static = _served(tmp_path)
    documented = _documented()
    assert len(api) >= 14  # (the reader finds the app's routes)
    assert api - documented == set(), "served, not in docs/api.md"
    assert documented - api - static == set(), "in docs/api.md, not served"
    text = DOC.read_text()
    for route in static - documented:  # the page's files: named in the playground's row
        path = route.split(" ", 1)[1].split("{}")[0].rstrip("/")
        assert path and path in text, route
