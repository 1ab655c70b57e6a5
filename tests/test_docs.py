"""The repository carries its own docs: nothing points outside it, and what they state of the
code holds (flags in docs/cli.md are checked by test_cli_help.py)."""

from __future__ import annotations

import ast
import os
import re

import pytest

from vllm_omni_like.stages.diffusion.acceleration import DEFAULT_BUCKETS

ROOT = os.path.join(os.path.dirname(__file__), "..")
DOCS = ["README.md", "bench/README.md", "training/README.md"] + [
    f"docs/{name}" for name in os.listdir(os.path.join(ROOT, "docs"))
]


def _read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def test_no_doc_points_outside_the_repository():
    for path in DOCS:
        assert "../shared" not in _read(path), path


def test_every_repository_path_a_doc_names_exists():
    for path in DOCS:
        for name in re.findall(
            r"`((?:docs|bench|training|examples|tools|tests)/[\w./-]+)`", _read(path)
        ):
            if "<" in name or "*" in name:
                continue
            assert os.path.exists(os.path.join(ROOT, name.split(":")[0])), (path, name)


def test_the_readme_states_the_default_batch_buckets():
    listed = ", ".join(str(b) for b in DEFAULT_BUCKETS)
    assert f"(default {listed} up to `--max-batch-size`)" in _read("README.md")


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end != -1 else len(text)]


@pytest.mark.parametrize(
    "heading", ["## The path of one diffusion step", "## The path of one token"]
)
def test_the_path_docs_architecture_lists_is_the_codes(heading):
    """docs/architecture.md walks one diffusion step (and one token) through at most five
    modules: each is where the doc says, and its docstring still opens as the doc quotes it."""
    listed = re.findall(
        r'^\d\. `(vllm_omni_like/[\w/]+\.py)`: "(.+)"$',
        _section(_read("docs/architecture.md"), heading),
        re.M,
    )
    assert 2 <= len(listed) <= 5, listed
    for path, first in listed:
        assert os.path.exists(os.path.join(ROOT, path)), path
        with open(os.path.join(ROOT, path)) as f:
            doc = ast.get_docstring(ast.parse(f.read())) or ""
        assert doc.splitlines()[0] == first, (path, doc.splitlines()[0])


def test_the_layout_names_every_module_of_the_worker_side_layers():
    """docs/architecture.md's layout names each module of engine/, executor/, stages/, models/
    and parallel/: a module added or renamed without the doc fails here."""
    doc = _read("docs/architecture.md")
    package = os.path.join(ROOT, "vllm_omni_like")
    missing = [
        os.path.relpath(os.path.join(where, name), package)
        for layer in ("engine", "executor", "stages", "models", "parallel")
        for where, _, names in os.walk(os.path.join(package, layer))
        for name in names
        if name.endswith(".py") and name != "__init__.py" and name not in doc
    ]
    assert missing == []
