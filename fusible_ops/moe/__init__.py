"""Mixture of Experts: routing, permutation, load balancing, expert parallelism, the layer.

Owns the top-k router and its score functions, permute / unpermute (tokens sorted by
expert and combined back), the balancing losses and aux-loss-free bias, expert
parallelism over ``torch.distributed``, the :class:`~fusible_ops.MoE` layer and the
checkpoint layouts of its experts. It builds on ``core``, ``fuser``, ``basic`` and
``kernels``; ``parallel``, ``integrations`` and ``cli`` build on it.

The routing helpers are importable from here: ``from fusible_ops.moe import permute``, and
so is ``expert_shard_placement`` (dp2ep in one FSDP2 unit), loaded on first use.
"""

from __future__ import annotations

from ..core.placement import ExpertPlacement
from .routing import Permutation, permute, topk_route, unpermute

__all__ = ["ExpertPlacement", "Permutation", "expert_shard_placement", "permute", "topk_route", "unpermute"]


def __getattr__(name: str) -> object:
    if name == "expert_shard_placement":  # loads the MoE layer: on first use only
        from .fsdp import expert_shard_placement

        return expert_shard_placement
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
