"""The ```python blocks of README.md and docs/*.md, so tests run the documentation verbatim.

Every ```python block either runs on its own, as written (its imports and set-up are in
it), or carries a marker: an HTML comment alone on the line right before its fence,
which a rendered page does not show.

- no marker: the block runs on its own, in a fresh namespace.
- ``<!-- continued -->``: the block goes on from the one before it in the same file and
  runs in the namespace that block left (a reader runs them in order). A chain is a
  block without this marker followed by every ``continued`` block after it.
- ``<!-- requires: MODULE[, MODULE...] -->``: runs on its own like an unmarked block when
  every MODULE can be imported (an optional dependency such as ``transformers``), and
  is skipped, naming the missing module, otherwise.
- ``<!-- fragment: REASON -->``: the block is not run. REASON says what it needs that a
  single CPU test process does not have (``torchrun``, a GPU, names from the reader's own
  code). A reason is required.

``tests/test_doc_blocks.py`` runs every chain of every documented file, except the files
whose blocks a dedicated test runs with more checks (``DEDICATED_TESTS``).
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: documented files whose runnable blocks a dedicated test executes (with extra checks);
#: tests/test_doc_blocks.py leaves them to it
DEDICATED_TESTS = {
    "docs/compile.md": "tests/test_docs_compile.py",
    "docs/extending.md": "tests/test_extending.py",
    "docs/moe.md": "tests/test_docs_moe.py",
}

_FENCE = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)
_MARKER = re.compile(r"<!--\s*(continued|fragment|requires)\s*(?::\s*(.*?))?\s*-->")


@dataclass(frozen=True)
class DocBlock:
    """One ```python block: where it is, its code and how it is tested."""

    path: str  #: relative to the repository root
    line: int  #: 1-based line of the opening fence
    code: str
    kind: str  #: "run", "continued", "requires" or "fragment"
    note: str = ""  #: the fragment's reason, or the required modules (comma-separated)

    @property
    def label(self) -> str:
        return f"{self.path}:{self.line}"

    def missing_modules(self) -> list[str]:
        """The required modules that cannot be imported here (``requires`` blocks only)."""
        if self.kind != "requires":
            return []
        names = [name.strip() for name in self.note.split(",") if name.strip()]
        return [name for name in names if importlib.util.find_spec(name) is None]


def documented_files() -> list[str]:
    """README.md and every Markdown file under docs/, relative to the repository root."""
    docs = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))
    return ["README.md", *docs]


def doc_blocks(relative_path: str) -> list[DocBlock]:
    """Every ```python block of ``relative_path``, in order, with its marker."""
    text = (ROOT / relative_path).read_text()
    blocks = []
    for match in _FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        marker = _MARKER.fullmatch(before)
        kind, note = ("run", "") if marker is None else (marker.group(1), (marker.group(2) or "").strip())
        if kind in ("fragment", "requires") and not note:
            raise ValueError(f"{relative_path}: a '{kind}' marker needs a reason or module: {before}")
        line = text.count("\n", 0, match.start()) + 1
        blocks.append(DocBlock(relative_path, line, match.group(1), kind, note))
    return blocks


def chains(relative_path: str) -> list[list[DocBlock]]:
    """The runnable blocks of ``relative_path`` grouped into chains: a block that runs on
    its own, then the ``continued`` blocks after it. Fragments are left out; a
    ``continued`` block must follow a runnable one."""
    result: list[list[DocBlock]] = []
    previous = None
    for block in doc_blocks(relative_path):
        if block.kind == "continued":
            if previous is None or previous.kind == "fragment":
                raise ValueError(f"{block.label}: a continued block must follow a block that runs")
            result[-1].append(block)
        elif block.kind != "fragment":
            result.append([block])
        previous = block
    return result


def run_chain(chain: list[DocBlock], namespace: dict | None = None) -> dict:
    """Executes the blocks of one chain in one namespace (fresh unless given) and returns it."""
    namespace = {"__name__": "doc_block"} if namespace is None else namespace
    for block in chain:
        exec(compile(block.code, block.label, "exec"), namespace)
    return namespace


def python_blocks(relative_path: str) -> list[str]:
    """The code of every block of ``relative_path`` that runs (fragments left out), in
    order; executed in order in one namespace, they run as the chains do."""
    return [block.code for chain in chains(relative_path) for block in chain]
