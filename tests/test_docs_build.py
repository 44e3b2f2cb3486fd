"""The API reference (docs/api) builds with warnings as errors, lists every public name,
and a public name or method without a docstring fails it."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api"
sys.path.insert(0, str(API))

from public_names import ENTRY_POINTS, missing_docstrings, module_names, own_doc  # noqa: E402


def _sphinx_build(source: Path, out: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-n", "-q", "-b", "html"]
    return subprocess.run([*command, str(source), str(out)], capture_output=True, text=True, cwd=ROOT)


def test_api_reference_builds_without_warnings(tmp_path):
    pytest.importorskip("sphinx")
    pytest.importorskip("transformers")  # the integrations' pages import them
    pytest.importorskip("torchtitan.models.common.moe")
    result = _sphinx_build(API, tmp_path / "html")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "WARNING" not in result.stderr, result.stderr[-4000:]
    page = (tmp_path / "html" / "index.html").read_text()
    for module_name in ENTRY_POINTS:
        for name in module_names(module_name):
            assert f'id="{module_name}.{name}"' in page, f"{module_name}.{name} is not in the reference"


def test_every_public_name_is_listed_in_the_reference():
    index = (API / "index.rst").read_text()
    for module_name in ENTRY_POINTS:
        for name in module_names(module_name):
            assert f":: {module_name}.{name}\n" in index, (
                f"docs/api/index.rst does not list {module_name}.{name}"
            )


@pytest.mark.parametrize("module_name", list(ENTRY_POINTS))
def test_every_public_name_and_method_has_a_docstring(module_name):
    if module_name.endswith(".transformers"):
        pytest.importorskip("transformers")
    assert missing_docstrings(module_name) == []


def test_named_methods_have_their_own_docstrings():
    import fusible_ops as fo

    for cls, member in [(fo.Sequential, "forward"), (fo.Sequential, "explain"), (fo.MoE, "forward")]:
        doc = own_doc(cls, member)
        assert doc and "Define the computation" not in doc, f"{cls.__name__}.{member}"
    forward_doc = inspect.getdoc(fo.Sequential.forward)
    assert "Args:" in forward_doc and "Returns:" in forward_doc


def test_a_missing_docstring_fails_the_build(tmp_path):
    """The same configuration on a module with one undocumented function and one
    undocumented method of a fusible-ops class: the build fails and names both."""
    pytest.importorskip("sphinx")
    (tmp_path / "probe_mod.py").write_text(
        "def documented():\n    '''Has one.'''\n\n\ndef undocumented():\n    pass\n\n\n"
        "class Op:\n    '''An op.'''\n\n    def run(self):\n        pass\n\n\n"
        "Op.__module__ = 'fusible_ops.probe'\n"
    )
    (tmp_path / "conf.py").write_text(
        f"import sys\nsys.path[:0] = [{str(API)!r}, {str(tmp_path)!r}]\nfrom conf import *  # noqa: F403\n"
    )
    (tmp_path / "index.rst").write_text(
        "Probe\n=====\n\n.. autofunction:: probe_mod.documented\n\n.. autofunction:: probe_mod.undocumented\n\n"
        ".. autoclass:: probe_mod.Op\n"
    )
    result = _sphinx_build(tmp_path, tmp_path / "html")
    assert result.returncode != 0
    assert "probe_mod.undocumented has no docstring" in result.stderr, result.stderr[-2000:]
    assert "probe_mod.Op.run has no docstring" in result.stderr, result.stderr[-2000:]
    assert "probe_mod.documented has no docstring" not in result.stderr
