"""Layering, import cost and packaging: what the source distribution ships."""

from __future__ import annotations

import ast
import fnmatch
import importlib.metadata
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile

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


#: top-level subpackages, which the docs also cite relative to fusible_ops/ (``kernels/library.py``)
_SUBPACKAGES = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
_CITED_PATH = re.compile(r"(?<![\w./-])((?:\.\./)?[\w.-]+(?:/[\w.*-]+)+\.(?:py|sh|md|json|png|rst|toml))")
_NOT_COPIED = shutil.ignore_patterns(
    ".git",
    "__pycache__",
    "*.egg-info",
    "build",
    "dist",
    ".venv",
    ".pytest_cache",
    ".hypothesis",
    ".ruff_cache",
    "bench-out",
    "gpu_check_results",
)


def _cited_paths() -> dict[str, set[str]]:
    """Repository paths that README.md and docs/*.md cite: ``{path: {citing files}}``.
    Paths outside the repository (``../``) are the docs' own business: they say so."""
    cited: dict[str, set[str]] = {}
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for path in _CITED_PATH.findall(doc.read_text()):
            if path.startswith("../"):
                continue
            if path.split("/", 1)[0] in _SUBPACKAGES:
                path = f"fusible_ops/{path}"
            cited.setdefault(path, set()).add(str(doc.relative_to(ROOT)))
    return cited


def test_cited_paths_exist():
    missing = {
        path: sorted(docs)
        for path, docs in _cited_paths().items()
        if not (list(ROOT.glob(path)) if "*" in path else (ROOT / path).exists())
    }
    assert not missing, missing


def test_source_distribution_ships_what_the_docs_cite(tmp_path):
    try:
        setuptools_version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("setuptools is not installed")
    if int(setuptools_version.split(".")[0]) < 77:
        pytest.skip(f"pyproject.toml needs setuptools >= 77, found {setuptools_version}")
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=_NOT_COPIED)
    build = "import sys\nfrom setuptools import build_meta\nprint(build_meta.build_sdist(sys.argv[1]))"
    result = subprocess.run(
        [sys.executable, "-c", build, str(tmp_path / "dist")], cwd=source, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    archive = tmp_path / "dist" / result.stdout.split()[-1]
    with tarfile.open(archive) as tar:
        shipped = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    unshipped = {
        path: sorted(docs)
        for path, docs in _cited_paths().items()
        if not (fnmatch.filter(shipped, path) if "*" in path else path in shipped)
    }
    assert not unshipped, unshipped
    tests = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("*.py")}
    assert tests <= shipped, sorted(tests - shipped)  # conftest.py and the helpers too
    assert not any(name.endswith((".pyc", ".pyo")) for name in shipped)
