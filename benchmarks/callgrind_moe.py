"""Per-call instructions of ``fo.MoE`` vs a plain torchtitan-style MoE module.

Run: ``python ../shared/tools/callgrind_ratio.py benchmarks/callgrind_moe.py``
(or every target at once: ``benchmarks/callgrind_all.py``).

8 experts, top-2, hidden 64, ffn 64, 64 tokens, fp32, SwiGLU experts. ``plain`` is the
same math as ``fo.MoE``'s default (softmax router, top-k weights renormalised, the
weight applied before fc2) written the way torchtitan writes it: router ``F.linear``,
``softmax``, ``topk``, a stable ``argsort`` of the chosen expert ids, ``histc`` counts,
``torch._grouped_mm`` twice, and an ``index_copy`` back to (token, k) order summed over
k. Both share the weights; each comes as ``fwd+bwd`` and ``no_grad``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fusible_ops as fo  # noqa: E402

EXPERTS, TOP_K, HIDDEN, FFN, TOKENS = 8, 2, 64, 64, 64


class PlainMoE(torch.nn.Module):
    """torchtitan-style token-choice MoE over ``moe``'s weights (shared, not copied)."""

    def __init__(self, moe: fo.MoE) -> None:
        super().__init__()
        self.router_weight = moe.router.weight
        self.w1 = moe.experts[0].weight  # [E, 2F, H]
        self.w2 = moe.experts[2].weight  # [E, H, F]
        self.num_experts, self.top_k = moe.num_experts, moe.top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, hidden = x.shape
        scores = torch.softmax(F.linear(x, self.router_weight).float(), dim=-1)
        top_scores, selected = torch.topk(scores, self.top_k, dim=-1)
        top_scores = top_scores / top_scores.sum(dim=-1, keepdim=True)
        flat = selected.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.histc(flat.float(), bins=self.num_experts, min=0, max=self.num_experts - 1)
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        rows = x.index_select(0, order // self.top_k)
        probs = top_scores.reshape(-1).index_select(0, order)
        h = torch._grouped_mm(rows, self.w1.transpose(-2, -1), offs=offsets)
        gate, up = h.chunk(2, dim=-1)
        y = torch._grouped_mm(
            F.silu(gate) * up * probs.unsqueeze(-1), self.w2.transpose(-2, -1), offs=offsets
        )
        combined = torch.zeros_like(y).index_copy(0, order, y)
        return combined.view(tokens, self.top_k, hidden).sum(dim=1)


def variants(prefix: str = "") -> dict[str, Callable[[], None]]:
    """``{name: call}``, the plain module first; ``fo.MoE`` checked against it."""
    torch.manual_seed(0)
    moe = fo.MoE(HIDDEN, FFN, EXPERTS, TOP_K)
    plain = PlainMoE(moe)
    x = torch.randn(TOKENS, HIDDEN)
    grad = torch.randn(TOKENS, HIDDEN)
    torch.testing.assert_close(moe(x), plain(x))
    layers = {"plain": plain, "fo.MoE": moe}

    def fwd_bwd(layer: torch.nn.Module) -> Callable[[], None]:
        def call() -> None:
            layer(x.detach().requires_grad_(True)).backward(grad)

        return call

    def no_grad(layer: torch.nn.Module) -> Callable[[], None]:
        def call() -> None:
            with torch.no_grad():
                layer(x)

        return call

    result = {}
    for mode, make in (("fwd+bwd", fwd_bwd), ("no_grad", no_grad)):
        for name, layer in layers.items():
            result[f"{prefix}{mode} {name}"] = make(layer)
    return result
