"""The playground: a web page at `/` to try every model, static files shipped in the package
(no build step, nothing from a CDN), served under a strict Content-Security-Policy."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from vllm_omni_like.errors import NotFoundError

router = APIRouter()
ROOT = Path(__file__).resolve().parent.parent / "playground"
TYPES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}
# scripts and styles only from these files (no inline code, so an injected tag cannot run);
# images and videos also from data: and blob: URLs (streamed partials, media fetched with a key)
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "media-src 'self' blob:; connect-src 'self'; form-action 'none'; base-uri 'none'; "
    "frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
_FILES = {name: (ROOT / name).read_bytes() for name in TYPES}


def _file(name: str) -> Response:
    return Response(_FILES[name], media_type=TYPES[name], headers=HEADERS)


@router.get("/", include_in_schema=False)
async def index() -> Response:
    return _file("index.html")


@router.get("/favicon.ico", include_in_schema=False)
async def favicon() -> Response:
    return _file("favicon.svg")


@router.get("/playground/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    if name not in _FILES:
        raise NotFoundError(f"no playground file {name!r}", code="not_found")
    return _file(name)
