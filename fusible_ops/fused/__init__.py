"""Fused operations, each with the fusion rule that builds it; importing this package registers the rules.

A fused op holds the basic ops it replaces and uses their parameters. This package
imports ``core``, ``fuser``, ``basic`` and ``kernels``; nothing below it imports it.
"""

from __future__ import annotations

from .dense import BackwardBiasActivation, ForwardLinearBiasActivation
from .grouped_mlp import GroupedMLP

__all__ = ["BackwardBiasActivation", "ForwardLinearBiasActivation", "GroupedMLP"]
