"""The demo's toy MoE regression under a low-precision recipe (docs/low-precision.md).

A teacher MLP, a router and a fused expert block trained with Adam; the loss on a fixed
evaluation batch after ``steps`` steps is what recipes are compared by.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

import fusible_ops as fo


class ToyMoE(NamedTuple):
    """A teacher MLP to regress, and a router + fused expert block (``moe``) trained by ``optimizer``."""

    teacher: torch.nn.Module
    moe: Callable[[torch.Tensor], torch.Tensor]
    optimizer: torch.optim.Optimizer
    hidden: int
    num_experts: int
    top_k: int


def build_toy_moe(recipe: fo.recipes.Recipe | None = None, seed: int = 1) -> ToyMoE:
    """The demo's toy MoE (4 experts, hidden 32, ffn 48, top-2), seeded; ``recipe`` on its experts."""
    torch.manual_seed(seed)
    experts_n, hidden, ffn, top_k = 4, 32, 48, 2
    teacher = torch.nn.Sequential(
        torch.nn.Linear(hidden, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, hidden)
    )
    router = torch.nn.Linear(hidden, experts_n, bias=False)
    experts = fo.Sequential(
        fo.GroupedLinear(experts_n, hidden, 2 * ffn),
        fo.ScaledSwiGLU(),
        fo.GroupedLinear(experts_n, ffn, hidden),
        recipe=recipe,
    )
    optimizer = torch.optim.Adam([*router.parameters(), *experts.parameters()], lr=3e-3)

    def moe(x: torch.Tensor) -> torch.Tensor:
        top_probs, top_experts = router(x).softmax(-1).topk(top_k, dim=-1)
        flat_experts = top_experts.reshape(-1)
        order = flat_experts.argsort(stable=True)
        token_of_row = order // top_k
        split_sizes = torch.bincount(flat_experts, minlength=experts_n)
        rows = experts(x[token_of_row], split_sizes, top_probs.reshape(-1)[order], split_sizes)
        return torch.zeros_like(x).index_add_(0, token_of_row, rows)

    return ToyMoE(teacher, moe, optimizer, hidden, experts_n, top_k)


def train_toy_moe(
    recipe: fo.recipes.Recipe | None, steps: int = 300, tokens: int = 256, seed: int = 1
) -> float:
    """Train for ``steps`` steps under ``recipe`` (None: unquantized); returns the final
    evaluation loss (mean squared error on 512 fixed tokens)."""
    toy = build_toy_moe(recipe, seed)
    eval_x = torch.randn(512, toy.hidden)
    with torch.no_grad():
        eval_target = toy.teacher(eval_x)
    for _ in range(steps):
        x = torch.randn(tokens, toy.hidden)
        with torch.no_grad():
            target = toy.teacher(x)
        loss = F.mse_loss(toy.moe(x), target)
        toy.optimizer.zero_grad()
        loss.backward()
        toy.optimizer.step()
    with torch.no_grad():
        return F.mse_loss(toy.moe(eval_x), eval_target).item()
