"""No class reads another object's private attribute: `x._name` only where `x` is `self` or
`cls`; what one object needs of another is public (a method, an attribute without `_`). Checked
in the packages named here (stages/diffusion: its loops and running set receive the load's
runtime and ask it, not the stage). A library module that is documented API despite its
underscore is listed with why."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "vllm_omni_like"
CHECKED = ["stages/diffusion"]
ALLOWED = {
    "torch._dynamo",  # torch.compile's documented config and reset (`torch._dynamo.config`)
    "torch._logging",  # `torch._logging.set_logs`: the documented switch for recompile logs
    "torch._scaled_mm",  # torch's one FP8 matmul (rowwise scales; torchao calls it too)
    # a torch.compile mode as its options (the one way to give a mode beside guard_filter_fn)
    "torch._inductor",
    # nn.Module's one hook under every .to() / .cuda() / .half(): an FP8 layer keeps its dtypes
    "super()._apply",
}


def private_reads(source: str) -> list[tuple[int, str]]:
    """(line, expression) of each `x._name` (read, set or deleted; dunders aside) where `x` is
    not `self` or `cls`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") and node.attr.endswith("__"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        expression = ast.unparse(node)
        if expression not in ALLOWED:
            found.append((node.lineno, expression))
    return sorted(found)


def test_the_scan_finds_another_objects_private_attribute_and_only_that():
    source = (
        "class A:\n"
        "    def f(self, other):\n"
        "        self._own = other.public + type(self).__name__\n"
        "        return self.loop._plan(other._rows) + torch._dynamo\n"
    )
    assert private_reads(source) == [(4, "other._rows"), (4, "self.loop._plan")]


def test_no_class_reads_another_objects_private_attribute():
    reads = [
        f"{path.relative_to(PACKAGE)}:{line}: {expression}"
        for package in CHECKED
        for path in sorted((PACKAGE / package).rglob("*.py"))
        for line, expression in private_reads(path.read_text())
    ]
    assert reads == []
