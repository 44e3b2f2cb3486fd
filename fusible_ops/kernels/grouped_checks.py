"""Argument checks shared by the grouped-GEMM backends.

Every check runs on shapes, dtypes and host ``split_sizes`` only, so it never reads
device memory (no host sync on CUDA). Each failure raises before any work, naming the
backend and the GEMM.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_operands(
    where: str,
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    split_sizes: Sequence[int] | None,
    offsets: torch.Tensor,
    *,
    lhs_name: str,
    rhs_name: str,
    num_groups: int | None = None,
) -> int:
    """Checks the two GEMM operands and the grouping; returns the number of groups.

    ``lhs`` is the row-grouped ``[M, *]`` operand. ``rhs`` is either the grouped weight
    ``[G, N, K]`` or, for wgrad, a second row-grouped ``[M, *]`` operand.
    """
    for name, t in ((lhs_name, lhs), (rhs_name, rhs)):
        if not t.is_floating_point():
            raise TypeError(f"{where}: {name} must be a floating-point tensor, got {t.dtype}")
    if lhs.dtype != rhs.dtype:
        raise TypeError(f"{where}: {lhs_name} dtype {lhs.dtype} != {rhs_name} dtype {rhs.dtype}")
    if lhs.device != rhs.device:
        raise ValueError(f"{where}: {lhs_name} is on {lhs.device} but {rhs_name} is on {rhs.device}")
    if lhs.dim() != 2:
        raise ValueError(f"{where}: {lhs_name} must be 2-D [rows, features], got shape {tuple(lhs.shape)}")
    if offsets.dim() != 1 or offsets.is_floating_point():
        raise ValueError(
            f"{where}: offsets must be a 1-D integer tensor, got {offsets.dtype} {tuple(offsets.shape)}"
        )
    if offsets.device != lhs.device:
        raise ValueError(f"{where}: offsets are on {offsets.device} but {lhs_name} is on {lhs.device}")
    groups = offsets.shape[0] if num_groups is None else num_groups
    if offsets.shape[0] != groups:
        raise ValueError(
            f"{where}: offsets has {offsets.shape[0]} entries, expected {groups} (one per group)"
        )
    if split_sizes is not None:
        if len(split_sizes) != groups:
            raise ValueError(f"{where}: {len(split_sizes)} split sizes for {groups} groups")
        if any(int(s) < 0 for s in split_sizes):
            raise ValueError(f"{where}: split sizes must be non-negative, got {list(split_sizes)}")
        total = sum(int(s) for s in split_sizes)
        if total > lhs.shape[0]:
            raise ValueError(
                f"{where}: split sizes sum to {total} but {lhs_name} has only {lhs.shape[0]} rows"
            )
    return groups


def check_weight(where: str, weight: torch.Tensor, groups: int, name: str = "weight") -> None:
    """``weight`` must be ``[groups, N, K]``."""
    if weight.dim() != 3 or weight.shape[0] != groups:
        raise ValueError(f"{where}: {name} must be [{groups}, out, in], got shape {tuple(weight.shape)}")


def check_out(
    where: str, out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> None:
    """``out`` (when given) must have exactly ``shape``, ``dtype`` and ``device``."""
    if out is None:
        return
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"{where}: out must have shape {tuple(shape)}, got {tuple(out.shape)}")
    if out.dtype != dtype:
        raise TypeError(f"{where}: out must have dtype {dtype}, got {out.dtype}")
    if out.device != device:
        raise ValueError(f"{where}: out must be on {device}, got {out.device}")


def check_bias(where: str, bias: torch.Tensor | None, groups: int, features: int, dtype: torch.dtype) -> None:
    """``bias`` (when given) must be ``[groups, features]`` of ``dtype``."""
    if bias is None:
        return
    if tuple(bias.shape) != (groups, features):
        raise ValueError(f"{where}: bias must have shape {(groups, features)}, got {tuple(bias.shape)}")
    if bias.dtype != dtype:
        raise TypeError(f"{where}: bias dtype {bias.dtype} != input dtype {dtype}")


def host_split_sizes(split_sizes: Sequence[int] | None, offsets: torch.Tensor) -> list[int]:
    """``split_sizes`` as ints; derived from ``offsets`` when None (a host sync on CUDA)."""
    if split_sizes is not None:
        return [int(s) for s in split_sizes]
    ends = [int(e) for e in offsets.tolist()]
    sizes = [e - s for s, e in zip([0, *ends[:-1]], ends)]
    if any(s < 0 for s in sizes):
        raise ValueError(f"offsets must be non-decreasing, got {ends}")
    return sizes


def check_fprop(
    where: str,
    x: torch.Tensor,
    weight: torch.Tensor,
    split_sizes: list[int] | None,
    offsets: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor | None,
) -> tuple[int, int, int]:
    """Every check of a backend's ``fprop``; returns ``(groups, out_features, in_features)``."""
    groups = check_operands(where, x, weight, split_sizes, offsets, lhs_name="x", rhs_name="weight")
    check_weight(where, weight, groups)
    n_out, k_in = weight.shape[1], weight.shape[2]
    if x.shape[1] != k_in:
        raise ValueError(f"{where}: x has {x.shape[1]} features but weight expects {k_in}")
    check_bias(where, bias, groups, n_out, x.dtype)
    check_out(where, out, (x.shape[0], n_out), x.dtype, x.device)
    return groups, n_out, k_in


def check_dgrad(
    where: str,
    grad_out: torch.Tensor,
    weight: torch.Tensor,
    split_sizes: list[int] | None,
    offsets: torch.Tensor,
    out: torch.Tensor | None,
) -> tuple[int, int, int]:
    """Every check of a backend's ``dgrad``; returns ``(groups, out_features, in_features)``."""
    groups = check_operands(
        where, grad_out, weight, split_sizes, offsets, lhs_name="grad_out", rhs_name="weight"
    )
    check_weight(where, weight, groups)
    n_out, k_in = weight.shape[1], weight.shape[2]
    if grad_out.shape[1] != n_out:
        raise ValueError(f"{where}: grad_out has {grad_out.shape[1]} features but weight has {n_out} outputs")
    check_out(where, out, (grad_out.shape[0], k_in), grad_out.dtype, grad_out.device)
    return groups, n_out, k_in


def check_wgrad(
    where: str,
    grad_out: torch.Tensor,
    x: torch.Tensor,
    split_sizes: list[int] | None,
    offsets: torch.Tensor,
    out: torch.Tensor | None,
) -> tuple[int, int, int]:
    """Every check of a backend's ``wgrad``; returns the result shape ``(groups, N, K)``."""
    groups = check_operands(where, grad_out, x, split_sizes, offsets, lhs_name="grad_out", rhs_name="x")
    if x.dim() != 2 or x.shape[0] != grad_out.shape[0]:
        raise ValueError(
            f"{where}: x must be [{grad_out.shape[0]}, in] like grad_out's rows, got {tuple(x.shape)}"
        )
    shape = (groups, grad_out.shape[1], x.shape[1])
    check_out(where, out, shape, x.dtype, x.device)
    return shape
