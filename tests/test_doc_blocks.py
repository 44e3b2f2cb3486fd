"""Every ```python block of README.md and docs/*.md runs as written, or says why not.

The markers are described in tests/doc_blocks.py. Each chain (a block that runs on its
own and the ``continued`` blocks after it) runs in a fresh namespace; files listed in
``DEDICATED_TESTS`` are run by their own tests, which check more.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import pytest
import torch
from doc_blocks import DEDICATED_TESTS, ROOT, chains, doc_blocks, documented_files, run_chain

import fusible_ops as fo


def _chain_params():
    params = []
    for path in documented_files():
        if path in DEDICATED_TESTS:
            continue
        for chain in chains(path):
            params.append(pytest.param(chain, id=chain[0].label))
    return params


@pytest.fixture
def clean_state():
    """A block may change process-wide state the way a reader's script would; undo it."""
    from fusible_ops.kernels.triton import backend as triton_backend

    autotune = triton_backend._autotune_default
    yield
    triton_backend._autotune_default = autotune
    torch._dynamo.reset()


@pytest.mark.parametrize("chain", _chain_params())
def test_doc_block_runs(chain, clean_state):
    missing = [name for block in chain for name in block.missing_modules()]
    if missing:
        pytest.skip(f"{chain[0].label} needs {', '.join(missing)}")
    settings_before = fo.current_settings()
    with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run_chain(chain)
    assert fo.current_settings() == settings_before, f"{chain[0].label} left settings changed"


def test_every_documented_file_is_covered():
    """Each file's runnable blocks are run here or by a dedicated test that exists and
    reads that file."""
    for path in documented_files():
        if path in DEDICATED_TESTS:
            test_file = ROOT / DEDICATED_TESTS[path]
            assert test_file.exists(), DEDICATED_TESTS[path]
            assert f'"{path}"' in test_file.read_text(), f"{DEDICATED_TESTS[path]} does not run {path}"


def test_every_block_is_runnable_or_marked():
    """A block is a fragment only with a reason, and most blocks run: the markers are the
    exception."""
    blocks = [block for path in documented_files() for block in doc_blocks(path)]
    fragments = [block for block in blocks if block.kind == "fragment"]
    assert all(block.note for block in fragments)
    assert len(fragments) * 3 < len(blocks), [block.label for block in fragments]


def test_markers_are_read(tmp_path, monkeypatch):
    import doc_blocks as module

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "probe.md").write_text(
        "```python\nx = 1\n```\n\n<!-- continued -->\n```python\ny = x + 1\n```\n\n"
        "<!-- fragment: needs torchrun -->\n```python\nmissing_name\n```\n\n"
        "<!-- requires: no_such_module_here -->\n```python\nimport no_such_module_here\n```\n"
    )
    monkeypatch.setattr(module, "ROOT", tmp_path)
    blocks = module.doc_blocks("docs/probe.md")
    assert [block.kind for block in blocks] == ["run", "continued", "fragment", "requires"]
    assert blocks[2].note == "needs torchrun"
    assert blocks[3].missing_modules() == ["no_such_module_here"]
    found = module.chains("docs/probe.md")
    assert [[block.line for block in chain] for chain in found] == [[1, 6], [16]]
    assert run_chain(found[0])["y"] == 2
    (tmp_path / "docs" / "bad.md").write_text("<!-- fragment -->\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="needs a reason"):
        module.doc_blocks("docs/bad.md")
