"""Fused operations; importing this package registers their fusion rules."""

from __future__ import annotations

from .dense import BackwardBiasActivation, ForwardLinearBiasActivation
from .grouped_mlp import GroupedMLP

__all__ = ["BackwardBiasActivation", "ForwardLinearBiasActivation", "GroupedMLP"]
