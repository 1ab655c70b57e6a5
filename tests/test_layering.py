"""The layers import only downwards: api -> protocol -> engine -> executor -> stages ->
messages/outputs -> config/errors; the offline batch command never imports the HTTP layer."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "vllm_omni_like"
# a layer may import those after it in this order, never those before it
ORDER = ["api", "batch", "protocol", "engine", "executor", "stages", "pipelines"]
BOTTOM = {"messages", "outputs", "config", "errors", "params", "stage_options", "cost"}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "vllm_omni_like" or len(parts) < 2:
        return None
    return parts[1]


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_no_layer_imports_one_above_it():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        own = _layer(".".join(rel.parts))
        for module in _imports(path):
            target = _layer(module)
            if own in BOTTOM and target in ORDER:
                upward.append(f"{rel} imports {module}")
            if own in ORDER and target in ORDER and ORDER.index(target) < ORDER.index(own):
                upward.append(f"{rel} imports {module}")
    assert upward == []


def test_the_batch_command_does_not_import_the_http_layer():
    imported = _imports(PACKAGE / "batch.py")
    assert not [m for m in imported if m.startswith("vllm_omni_like.api")]
    assert not [m for m in imported if m.split(".")[0] in ("fastapi", "uvicorn", "starlette")]
