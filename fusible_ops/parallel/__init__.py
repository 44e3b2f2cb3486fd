# ruff: noqa: F401  (re-exports)
"""Parallelism: tensor-parallel linear dispatch and modules, expert parallelism."""

from __future__ import annotations

from .expert_parallel import DispatchState, ExpertParallel, all_to_all_rows
from .tp_linear import (
    PATH_ASYNC_TP,
    PATH_BMM,
    PATH_LINEAR,
    PATH_MM,
    _async_tp_linear,
    _is_async_tp_linear_enabled,
    select_tp_linear_path,
    tp_linear_forward,
)
from .tp_modules import (
    LinearLoRA,
    TPLinear,
    lora_colwise_parallel,
    lora_rowwise_parallel,
    shard_colwise,
    shard_rowwise,
)
