"""Per-call instructions of a transformers experts module: ``fusible_ops`` vs ``grouped_mm``.

Run: ``python ../shared/tools/callgrind_ratio.py benchmarks/callgrind_hf.py``
(or every target at once: ``benchmarks/callgrind_all.py``). Needs ``transformers``.

The experts module of a one-layer Mixtral built from its config (8 experts, top-2,
hidden 64, ffn 64, 64 tokens, fp32, random weights, fixed routing), called as the
model calls it, ``experts(hidden_states, top_k_index, top_k_weights)``, with
transformers' ``grouped_mm`` experts implementation and with ``fusible_ops``
(``set_experts_implementation("fusible_ops")``; the config switch is set in every call
of both). Each comes as ``fwd+bwd`` and ``no_grad``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fusible_ops.cli.hf_bench import HfShape, experts_module  # noqa: E402

SHAPE = HfShape(tokens=64, hidden=64, experts=8, ffn=64, top_k=2)


def variants(prefix: str = "") -> dict[str, Callable[[], None]]:
    """``{name: call}``, ``grouped_mm`` first; ``fusible_ops`` checked against it."""
    experts = experts_module("mixtral", SHAPE, torch.float32)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SHAPE.tokens, SHAPE.hidden, generator=gen)
    probs, top_k = torch.softmax(torch.randn(SHAPE.tokens, SHAPE.experts, generator=gen), -1).topk(
        SHAPE.top_k
    )
    weights = probs / probs.sum(-1, keepdim=True)
    grad = torch.randn(SHAPE.tokens, SHAPE.hidden, generator=gen)
    config = experts.config

    def forward(implementation: str, x: torch.Tensor) -> torch.Tensor:
        config._experts_implementation = implementation
        return experts(x, top_k, weights)

    torch.testing.assert_close(forward("fusible_ops", x), forward("grouped_mm", x))

    def fwd_bwd(implementation: str) -> Callable[[], None]:
        def call() -> None:
            forward(implementation, x.detach().requires_grad_(True)).backward(grad)

        return call

    def no_grad(implementation: str) -> Callable[[], None]:
        def call() -> None:
            with torch.no_grad():
                forward(implementation, x)

        return call

    result = {}
    for mode, make in (("fwd+bwd", fwd_bwd), ("no_grad", no_grad)):
        for implementation in ("grouped_mm", "fusible_ops"):
            result[f"{prefix}{mode} {implementation}"] = make(implementation)
    return result
