"""docs/compile.md's examples run as written."""

from __future__ import annotations

import torch
from doc_blocks import python_blocks


def test_compile_doc_examples_run():
    blocks = python_blocks("docs/compile.md")
    assert len(blocks) >= 2
    namespace: dict = {}
    try:
        for block in blocks:  # later blocks reuse names from earlier ones, as a reader would
            exec(compile(block, "docs/compile.md", "exec"), namespace)
    finally:
        torch._dynamo.reset()
    assert namespace["out"].shape == (16, 64)
    assert namespace["x"].grad is not None
