"""Per-call instructions of the expert block: fused vs a plain ``torch._grouped_mm`` composition.

Run: ``python ../shared/tools/callgrind_ratio.py benchmarks/callgrind_expert_block.py``
(or every target at once: ``benchmarks/callgrind_all.py``).

4 experts, hidden 64, ffn 64, 64 rows (uneven splits, one expert empty), fp32: the GEMMs
are tiny, so the count is the per-call overhead (Python, dispatch, checks). Variants, on
the same weights and inputs:

- ``grouped_mm``: int32 offsets by ``torch.cumsum`` of the split-size tensor, two
  ``torch._grouped_mm`` and ``silu(gate) * up * probs`` between them, autograd;
- ``fused``: ``fo.Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear)`` (the
  GroupedMLP plan);
- ``unfused``: the same Sequential under ``fo.settings(fusion=False)``.

Each comes as ``fwd+bwd`` (fresh input leaves, forward, ``backward``) and ``no_grad``
(forward under ``torch.no_grad``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fusible_ops as fo  # noqa: E402
from fusible_ops.cli import bench  # noqa: E402

SHAPE = bench.Shape(experts=4, hidden=64, ffn=64, rows=64)

Forward = Callable[[bench.Problem, torch.Tensor, torch.Tensor], torch.Tensor]


def _fwd_bwd(p: bench.Problem, forward: Forward) -> Callable[[], None]:
    def call() -> None:
        x = p.x.detach().requires_grad_(True)
        probs = p.probs.detach().requires_grad_(True)
        forward(p, x, probs).backward(p.grad_y)

    return call


def _no_grad(p: bench.Problem, forward: Forward) -> Callable[[], None]:
    def call() -> None:
        with torch.no_grad():
            forward(p, p.x, p.probs)

    return call


def _unfused(p: bench.Problem, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    with fo.settings(fusion=False):
        return p.experts(x, p.splits_tensor, probs, p.splits_tensor)


def variants(prefix: str = "") -> dict[str, Callable[[], None]]:
    """``{name: call}``, the composition first; every variant checked against it."""
    p = bench.make_problem(SHAPE, torch.float32, torch.device("cpu"))
    forwards: dict[str, Forward] = {
        "grouped_mm": bench.grouped_mm_forward,
        "fused": bench.fused_forward,
        "unfused": _unfused,
    }
    reference = bench.grouped_mm_forward(p, p.x, p.probs)
    for name, forward in forwards.items():
        torch.testing.assert_close(forward(p, p.x, p.probs), reference, msg=name)
    result = {}
    for mode, make in (("fwd+bwd", _fwd_bwd), ("no_grad", _no_grad)):
        for name, forward in forwards.items():
            result[f"{prefix}{mode} {name}"] = make(p, forward)
    return result
