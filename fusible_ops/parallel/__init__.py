"""Parallelism: tensor-parallel linear dispatch and modules; expert parallelism re-exported.

Owns the tensor-parallel modules (``TPLinear``, LoRA, sharding helpers). The linear
dispatch lives with ``BasicLinear`` in ``basic``, expert parallelism with the MoE layer in
``moe``; both are re-exported here. It may import ``core`` to ``moe``; only
``integrations`` and ``cli`` sit above it.

Names load on first use (PEP 562), so importing one of them does not import the rest:
``from fusible_ops.parallel import TPLinear`` leaves expert parallelism unloaded.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DispatchState": "..moe.expert_parallel",
    "ExpertParallel": "..moe.expert_parallel",
    "all_to_all_rows": "..moe.expert_parallel",
    "PATH_ASYNC_TP": "..basic.linear_dispatch",
    "PATH_BMM": "..basic.linear_dispatch",
    "PATH_LINEAR": "..basic.linear_dispatch",
    "PATH_MM": "..basic.linear_dispatch",
    "_async_tp_linear": "..basic.linear_dispatch",
    "_is_async_tp_linear_enabled": "..basic.linear_dispatch",
    "select_tp_linear_path": "..basic.linear_dispatch",
    "tp_linear_forward": "..basic.linear_dispatch",
    "LinearLoRA": ".tp_modules",
    "TPLinear": ".tp_modules",
    "lora_colwise_parallel": ".tp_modules",
    "lora_rowwise_parallel": ".tp_modules",
    "shard_colwise": ".tp_modules",
    "shard_rowwise": ".tp_modules",
}

__all__ = [name for name in _EXPORTS if not name.startswith("_")]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
