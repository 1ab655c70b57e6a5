"""Write docs/cli.md from the command line's own help (tests/test_cli_help.py checks it is current).

python tools/write_cli_doc.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from vllm_omni_like.cli import help_texts

HEADER = """# Command line

`vllm-omni-like serve` runs the HTTP server; `vllm-omni-like generate` runs an offline batch over
a JSONL file. Every flag shows its default. Stage flags override every stage of every pipeline
(a YAML pipeline can set them per stage); the model limits default to each model's own, which
`GET /v1/models` shows. This page is written from the parser itself by
`python tools/write_cli_doc.py`; a test fails when it falls behind the code.
"""


def render() -> str:
    parts = [HEADER]
    for command, text in help_texts().items():
        parts.append(f"\n## `vllm-omni-like {command}`\n\n```text\n{text.rstrip()}\n```\n")
    return "".join(parts)


if __name__ == "__main__":
    path = os.path.join(os.path.dirname(__file__), "..", "docs", "cli.md")
    with open(path, "w") as f:
        f.write(render())
    print(f"wrote {os.path.normpath(path)}")
