"""Error helpers of the fuser: dense-tensor checks and op locations in messages."""

from __future__ import annotations

from typing import Any

import torch

from ..core.op import TensorMeta


def is_dtensor(tensor: Any) -> bool:
    return type(tensor).__name__ == "DTensor"


def check_dense(op_name: str, what: str, tensor: torch.Tensor) -> None:
    """Sparse and meta tensors have no dense data for the kernels: a clear error, not a raw one."""
    if tensor.layout != torch.strided:
        raise ValueError(
            f"{op_name}: {what} has layout {tensor.layout}; only dense (strided) tensors are supported"
        )
    if tensor.is_meta:
        raise ValueError(f"{op_name}: {what} is a meta tensor (shape only, no data); the op needs real data")


def check_kernel_params(ops: Any, dicts: list[dict[str, torch.Tensor | None]]) -> None:
    """Refuse a sharded DTensor parameter of an op whose kernels cannot take one."""
    for op, params in zip(ops, dicts):
        if op.accepts_dtensor:
            continue
        for name, tensor in params.items():
            if is_dtensor(tensor):
                raise ValueError(
                    f"{op.op_name()}: parameter {name!r} is a DTensor (sharded, e.g. by fully_shard), "
                    "which this op's kernels cannot take; apply fully_shard to the op itself (it then "
                    "runs alone and FSDP unshards it for the call) or to the enclosing Sequential"
                )


def located_error(fuser: Any, error: Exception, index: int, meta: TensorMeta) -> Exception:
    """``error`` from ``ops[index]``'s checks, with where the op sits and, for a width
    mismatch after a gated activation, what the width should have been."""
    if type(error) not in (ValueError, TypeError):
        return error
    notes = []
    if fuser.first_index is not None:
        notes.append(f"op {fuser.first_index + index} of the Sequential")
    previous = fuser.ops[index - 1] if index else None
    spec = getattr(previous, "spec", None)
    in_features = getattr(fuser.ops[index], "in_features", None)
    if (
        spec is not None
        and getattr(spec, "gated", False)
        and meta.shape
        and in_features == 2 * meta.shape[-1]
    ):
        notes.append(
            f"{fuser.label(index - 1)} is a gated activation and halves the width, so the op "
            f"before it must produce {2 * in_features} columns, not {in_features}"
        )
    return type(error)(f"{error} ({'; '.join(notes)})") if notes else error
