"""Checkpoint layouts of MoE experts: stacked, per-expert and grouped keys (see docs/moe.md).

The public entry point for ``fusible_ops.moe.checkpoint``.
"""

from __future__ import annotations

from .moe.checkpoint import (
    expert_range,
    export_grouped_keys,
    export_per_expert,
    export_stacked,
    load_grouped_keys,
    load_per_expert,
    load_per_expert_state_dict,
    load_stacked,
)

__all__ = [
    "expert_range",
    "export_grouped_keys",
    "export_per_expert",
    "export_stacked",
    "load_grouped_keys",
    "load_per_expert",
    "load_per_expert_state_dict",
    "load_stacked",
]
