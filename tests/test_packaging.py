"""Layering, import cost and packaging (issue 15 items 4 and 10)."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fusible_ops"


def _imported_modules(path: pathlib.Path) -> list[str]:
    """Absolute names of what ``path`` imports (relative imports resolved)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            names.append(module)
            names.extend(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_basic_ops_import_nothing_from_parallel():
    offenders = {
        str(path.relative_to(ROOT)): name
        for path in (PACKAGE / "basic").glob("*.py")
        for name in _imported_modules(path)
        if name.startswith("fusible_ops.parallel")
    }
    assert not offenders, offenders


def test_no_package_file_over_500_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 500
    }
    assert not long, long


def _loaded_after(code: str) -> set[str]:
    script = f"import sys\n{code}\nprint('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True).stdout
    return set(out.split())


def test_importing_the_package_loads_no_distributed_or_compiler_modules_of_its_own():
    bare = _loaded_after("import torch")
    with_package = _loaded_after("import torch, fusible_ops")
    added = with_package - bare
    unwanted = sorted(
        m for m in added if m.startswith(("torch.distributed", "torch._dynamo", "torch._inductor"))
    )
    assert not unwanted, unwanted[:10]
    assert "fusible_ops.moe.expert_parallel" not in with_package
    assert not any(m.startswith(("triton", "cudnn", "transformers")) for m in added)
    assert "fusible_ops.integrations.transformers" not in with_package


def test_parallel_names_load_on_first_use():
    loaded = _loaded_after("from fusible_ops.parallel import TPLinear")
    assert "fusible_ops.parallel.tp_modules" in loaded
    assert "fusible_ops.moe.expert_parallel" not in loaded
    # the old module path still names the dispatch module itself (monkeypatching works)
    import fusible_ops.basic.linear_dispatch as dispatch
    import fusible_ops.parallel.tp_linear as alias

    assert alias is dispatch


def test_packaging_metadata():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"  # an SPDX expression, not the deprecated table
    assert project["license-files"] == ["LICENSE"]
    assert "urls" not in project  # none invented
    assert (
        "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
    )
    assert (PACKAGE / "py.typed").exists()
    readme = (ROOT / "README.md").read_text()
    assert "](docs/" not in readme, "relative links do not resolve on a package index page"
