"""The package layout: subpackages by concern, layered, without import cycles, small files.

Read from the code's own imports (every ``import`` and ``from ... import`` statement,
also inside functions and ``TYPE_CHECKING`` blocks), so a lazy import counts as an edge.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fusible_ops"

# lowest first: a subpackage may import only those before it
LAYERS = ["core", "recipes", "kernels", "fuser", "basic", "fused", "moe", "parallel", "integrations", "cli"]
# the package root holds only the public entry points, which may import anything
ROOT_MODULES = {"__init__", "__main__", "checkpoint"}
# kernel backend families: each may import the shared kernel modules and those listed
BACKEND_FAMILIES = {"pytorch": set(), "cpu": {"pytorch"}, "triton": set(), "cudnn": {"pytorch"}}
MAX_LINES = 500
# imports by module name that go up a layer on purpose: the fuser loads the built-in fusion
# rules (fused ops register themselves on import) however a fuser is reached
# registries filled by name: the lower module imports the higher one only to let it register
ALLOWED_UPWARD = {
    ("fusible_ops.fuser.rules", "fusible_ops.fused"),
    ("fusible_ops.core.settings", "fusible_ops.kernels"),
    ("fusible_ops.core.settings", "fusible_ops.recipes"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of every fusible_ops module or name ``path`` imports."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "fusible_ops" or name.startswith("fusible_ops.")}


def _string_module_refs(path: Path) -> set[str]:
    """Module paths named in string constants (lazy-import tables, importlib calls)."""
    refs = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            value = node.value
            if value.startswith("fusible_ops.") and " " not in value and _is_module_path(value):
                refs.add(value)
    return refs


def _is_module_path(name: str) -> bool:
    """Whether a dotted name starts with a real module or package of fusible_ops."""
    first = name.split(".")[1]
    return bool(first) and ((PACKAGE / first).is_dir() or (PACKAGE / f"{first}.py").is_file())


def _subpackage(name: str) -> str | None:
    """The first-level subpackage of a module name, None for the package root's modules."""
    parts = name.split(".")
    if len(parts) < 2 or parts[1] in ROOT_MODULES:
        return None
    return parts[1]


def _all_modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _edges() -> list[tuple[str, str, str]]:
    """(importing module, imported name, how) for every import between two subpackages."""
    edges = []
    for path in _all_modules():
        module = _module_name(path)
        for target in _imports(path) | _string_module_refs(path):
            edges.append((module, target, str(path.relative_to(PACKAGE.parent))))
    return edges


def test_every_module_lives_in_a_known_subpackage_or_is_a_root_entry_point() -> None:
    for path in _all_modules():
        rel = path.relative_to(PACKAGE)
        if len(rel.parts) == 1:
            assert rel.stem in ROOT_MODULES, f"{rel} sits in the package root; move it into a subpackage"
        else:
            assert rel.parts[0] in LAYERS, f"{rel}: unknown subpackage {rel.parts[0]!r}; add it to LAYERS"


def test_lower_layers_never_import_higher_ones() -> None:
    rank = {name: i for i, name in enumerate(LAYERS)}
    bad = []
    for module, target, where in _edges():
        src, dst = _subpackage(module), _subpackage(target)
        if src is None:
            continue  # a root entry point may import anything
        if dst is None:
            if target != "fusible_ops":  # "from .. import x" of a subpackage resolves below
                bad.append(f"{where}: {module} imports the root entry point {target}")
            continue
        if src != dst and rank[dst] > rank[src] and (module, target) not in ALLOWED_UPWARD:
            bad.append(f"{where}: {src} imports the higher layer {dst} ({target})")
    assert not bad, "\n".join(bad)


def test_no_import_cycle_between_subpackages() -> None:
    graph: dict[str, set[str]] = {}
    for module, target, _ in _edges():
        src, dst = _subpackage(module), _subpackage(target)
        if src and dst and src != dst and (module, target) not in ALLOWED_UPWARD:
            graph.setdefault(src, set()).add(dst)

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cycles = [name for name in graph if reaches(name, name, {name})]
    assert not cycles, f"subpackages on an import cycle: {cycles} (graph: {graph})"


def test_kernel_backend_families_import_only_shared_kernel_code() -> None:
    bad = []
    for module, target, where in _edges():
        parts, tparts = module.split("."), target.split(".")
        if len(parts) < 4 or parts[1] != "kernels" or parts[2] not in BACKEND_FAMILIES:
            continue
        if len(tparts) >= 3 and tparts[1] == "kernels" and tparts[2] in BACKEND_FAMILIES:
            family, other = parts[2], tparts[2]
            if other != family and other not in BACKEND_FAMILIES[family]:
                bad.append(f"{where}: backend family {family} imports backend family {other}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("name", LAYERS)
def test_each_subpackage_says_what_it_owns_and_may_import(name: str) -> None:
    init = PACKAGE / name / "__init__.py"
    if not init.exists():
        pytest.skip(f"no {name}/ subpackage")
    doc = ast.get_docstring(ast.parse(init.read_text()))
    assert doc and len(doc.split()) >= 20, f"fusible_ops/{name}/__init__.py needs a docstring paragraph"
    assert "import" in doc, f"fusible_ops/{name}/__init__.py: say what the subpackage may import"


def test_no_file_over_the_line_limit() -> None:
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in _all_modules()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_the_layout_test_sees_imports() -> None:
    # the checks above would pass vacuously if import parsing found nothing
    edges = _edges()
    assert any(t.startswith("fusible_ops.core") for _, t, _ in edges)
    assert any(m.startswith("fusible_ops.moe") and t.startswith("fusible_ops.basic") for m, t, _ in edges)
