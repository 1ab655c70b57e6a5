"""The layers import only downwards: api -> protocol -> engine -> executor -> stages ->
pipelines -> models -> parallel -> wire/inputs/outputs -> config/errors; the offline batch command
never imports the HTTP layer; no model class, and no parameter only some families take, is named
outside models/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "vllm_omni_like"
# a layer may import those after it in this order, never those before it
ORDER = [
    "api",
    "batch",
    "protocol",
    "engine",
    "executor",
    "stages",
    "pipelines",
    "models",
    "parallel",
]
BOTTOM = {
    "wire",
    "inputs",
    "outputs",
    "config",
    "compile_choices",
    "errors",
    "params",
    "stage_options",
    "cost",
    "loras",
}


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


def _imported_modules(path: Path, known: set[str]) -> set[str]:
    """The package's modules `path` imports (`from package import module` counted as the
    module)."""
    found = {m for m in _imports(path) if m in known}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{a.name}" for a in node.names} & known
    return found


def test_no_two_modules_import_each_other():
    """A module that imports another (at its top, in a function or for type checking only) is
    not imported back by it: a pair that needs each other is one piece cut in two."""
    modules = {
        ".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts): p
        for p in PACKAGE.rglob("*.py")
    }
    graph = {name: _imported_modules(path, set(modules)) for name, path in modules.items()}
    both = sorted(
        (a, b) for a, found in graph.items() for b in found if a < b and a in graph.get(b, ())
    )
    assert both == []


def test_the_batch_command_does_not_import_the_http_layer():
    imported = _imports(PACKAGE / "batch.py")
    assert not [m for m in imported if m.startswith("vllm_omni_like.api")]
    assert not [m for m in imported if m.split(".")[0] in ("fastapi", "uvicorn", "starlette")]


MODEL_CLASSES = re.compile(
    r"^(StableDiffusion|UNet2D|AutoencoderKL|Wan|Flux|QwenImage|ZImage|SD3|CogVideo|HunyuanVideo)"
)


def _names_and_strings(tree: ast.AST) -> set[str]:
    """Identifiers, attributes and string constants of a module, less its docstrings."""
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.add(node.name.split(".")[-1])
        elif isinstance(node, (ast.keyword, ast.arg)) and node.arg:  # f(x=...), def f(x)
            found.add(node.arg)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docstrings
        ):
            found.add(node.value)
    return found


def test_no_model_class_is_named_outside_models():
    """Model knowledge lives in its family's adapter: api, protocol, engine, executor, stages,
    pipelines and parallel name no model or pipeline class (the families' modules under
    models/ do)."""
    named = []
    for layer in ("api", "protocol", "engine", "executor", "stages", "pipelines", "parallel"):
        for path in (PACKAGE / layer).rglob("*.py"):
            tree = ast.parse(path.read_text())
            hits = sorted(n for n in _names_and_strings(tree) if MODEL_CLASSES.match(n))
            named += [f"{path.relative_to(PACKAGE)}: {hit}" for hit in hits]
    assert named == []


# the call arguments and config keys of some families only (Wan2.2-A14B's second expert and
# its scale, TI2V's per-token timesteps, Qwen-Image's true CFG, config keys the limits read)
FAMILY_PARAMS = re.compile(
    r"\b(guidance_scale_2|transformer_2|boundary_ratio|expand_timesteps|true_cfg_scale"
    r"|shift_terminal|temperal_downsample|pos_embed_max_size|rope_max_seq_len)\b"
)
# the request schema and the params that carry a request's value name its field
CARRIERS = ("protocol/schemas.py", "params.py")


def test_no_family_parameter_is_named_outside_models():
    """A parameter only some families take is the families' knowledge: outside models/ (and
    the request's schema and params) no identifier, argument or string names it - the adapter
    builds the call's arguments, models/limits.py checks a request for it."""
    named = []
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "models" or rel.as_posix() in CARRIERS:
            continue
        names = _names_and_strings(ast.parse(path.read_text()))
        hits = sorted({m for n in names for m in FAMILY_PARAMS.findall(n)})
        named += [f"{rel}: {hit}" for hit in hits]
    assert named == []
