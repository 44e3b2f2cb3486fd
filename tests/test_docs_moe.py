"""docs/moe.md's single-process examples run as written (the distributed ones, which need
torchrun, are what test_moe_ep and test_moe_dtensor check)."""

from __future__ import annotations

from doc_blocks import python_blocks


def test_moe_doc_examples_run():
    blocks = python_blocks("docs/moe.md")
    runnable = [b for b in blocks if "init_process_group" not in b and "init_device_mesh" not in b]
    assert len(runnable) >= 4
    namespace: dict = {}
    for block in runnable:  # later blocks reuse names from earlier ones, as a reader would
        exec(compile(block, "docs/moe.md", "exec"), namespace)
    assert namespace["out"].shape == (10, 32)
