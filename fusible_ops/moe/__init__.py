"""Mixture of Experts: routing, permutation, load balancing, expert parallelism, the layer.

Owns the top-k router and its score functions, permute / unpermute (tokens sorted by
expert and combined back), the balancing losses and aux-loss-free bias, expert
parallelism over ``torch.distributed``, the :class:`~fusible_ops.MoE` layer and the
checkpoint layouts of its experts. It builds on ``core``, ``fuser``, ``basic`` and
``kernels``; ``parallel``, ``integrations`` and ``cli`` build on it.

The routing helpers are importable from here: ``from fusible_ops.moe import permute``.
"""

from __future__ import annotations

from ..core.placement import ExpertPlacement
from .routing import Permutation, permute, topk_route, unpermute

__all__ = ["ExpertPlacement", "Permutation", "permute", "topk_route", "unpermute"]
