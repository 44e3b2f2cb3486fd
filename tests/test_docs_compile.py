"""docs/compile.md's examples run as written."""

from __future__ import annotations

import torch
from doc_blocks import chains, run_chain


def test_compile_doc_examples_run():
    found = chains("docs/compile.md")
    # the compile example continued by the SAC one; then the sac_policy one on its own
    assert len(found) == 2 and len(found[0]) >= 2
    try:
        namespace = run_chain(found[0])
    finally:
        torch._dynamo.reset()
    assert namespace["out"].shape == (16, 64)
    assert namespace["x"].grad is not None
    namespace = run_chain(found[1])
    assert namespace["x"].grad.shape == (5, 8)
