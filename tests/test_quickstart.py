"""README's quickstart runs verbatim (its own asserts check the buffers)."""

from __future__ import annotations

import contextlib
import io

import torch
from doc_blocks import python_blocks

import fusible_ops as fo


def test_readme_quickstart_runs():
    blocks = python_blocks("README.md")
    assert blocks, "README.md has no ```python block"
    namespace: dict = {"__name__": "readme_quickstart"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(blocks[0], "README.md:quickstart", "exec"), namespace)
    # the names the quickstart promises exist and hold what it says
    out, x = namespace["out"], namespace["x"]
    assert isinstance(namespace["experts"], fo.Sequential)
    assert out.data_ptr() == namespace["combine_buf"].data_ptr()
    assert torch.equal(x.grad, namespace["dispatch_grad_buf"])
    assert "GroupedMLP" in printed.getvalue()
