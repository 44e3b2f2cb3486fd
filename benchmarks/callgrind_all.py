"""Every per-call instruction target in one callgrind run (torch is imported once).

Count: ``python ../shared/tools/callgrind_ratio.py benchmarks/callgrind_all.py | tee counts.txt``
Ratios per target: ``python benchmarks/callgrind_all.py < counts.txt``

The variants of ``callgrind_expert_block``, ``callgrind_moe`` and ``callgrind_hf`` (that
one only when transformers is installed), named ``"TARGET MODE IMPLEMENTATION"``. The
tool compares every variant with the first; reading its output, this script prints each
variant against the first variant of its own ``TARGET MODE`` group (the plain-PyTorch
reference).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import callgrind_expert_block  # noqa: E402
import callgrind_moe  # noqa: E402


def variants() -> dict[str, Callable[[], None]]:
    result = {}
    result.update(callgrind_expert_block.variants("block "))
    result.update(callgrind_moe.variants("moe "))
    if importlib.util.find_spec("transformers") is not None:
        import callgrind_hf

        result.update(callgrind_hf.variants("hf "))
    return result


def group_ratios(lines: list[str]) -> list[str]:
    """The tool's output lines, each variant against the first of its ``TARGET MODE`` group."""
    references: dict[str, float] = {}
    report = []
    for line in lines:
        match = re.match(r"^(\S+) (\S+) (.+?)\s+([\d,]+) instructions/call", line)
        if not match:
            continue
        target, mode, name, count = match.groups()
        per_call = float(count.replace(",", ""))
        group = f"{target} {mode}"
        reference = references.setdefault(group, per_call)
        report.append(f"{group:16s} {name:12s} {per_call:12,.0f}  {per_call / reference:6.3f}x")
    return report


if __name__ == "__main__":
    print("\n".join(group_ratios(sys.stdin.read().splitlines())))
