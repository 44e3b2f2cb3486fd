"""Extract the ```python blocks of a Markdown file so tests run documentation verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def python_blocks(relative_path: str) -> list[str]:
    """The bodies of every ```python fenced block of ``relative_path``, in order."""
    text = (ROOT / relative_path).read_text()
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
