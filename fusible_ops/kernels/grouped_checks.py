"""Argument checks shared by the grouped-GEMM backends.

:class:`~fusible_ops.kernels.base.GroupedGemmBackend` runs them once per public call,
before any backend hook. Every check runs on shapes, dtypes and host ``split_sizes``
only, so it never reads device memory (no host sync on CUDA). Each failure raises
before any work, naming the backend and the GEMM (``where``): ``TypeError`` for a wrong
dtype, ``ValueError`` for a wrong shape, device or grouping.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..core.shapes import as_flat
from .activation import ActivationSpec


def check_operands(
    where: str,
    lhs: torch.Tensor,
    rhs: torch.Tensor | None,
    split_sizes: Sequence[int] | None,
    offsets: torch.Tensor,
    *,
    lhs_name: str,
    rhs_name: str = "",
    num_groups: int | None = None,
) -> int:
    """Checks the GEMM operands and the grouping; returns the number of groups.

    ``lhs`` is the row-grouped ``[M, *]`` operand. ``rhs`` is the grouped weight
    ``[G, N, K]``, a second row-grouped ``[M, *]`` operand (wgrad), or None (bias_grad).
    """
    if not lhs.is_floating_point():
        raise TypeError(f"{where}: {lhs_name} must be a floating-point tensor, got {lhs.dtype}")
    if rhs is not None:
        if not rhs.is_floating_point():
            raise TypeError(f"{where}: {rhs_name} must be a floating-point tensor, got {rhs.dtype}")
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
        if groups and min(split_sizes) < 0:
            raise ValueError(f"{where}: split sizes must be non-negative, got {list(split_sizes)}")
        total = sum(split_sizes)
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
    if type(split_sizes) is list:
        return split_sizes
    if split_sizes is not None:
        return [int(s) for s in split_sizes]
    ends = [int(e) for e in offsets.tolist()]
    sizes = [e - s for s, e in zip([0, *ends[:-1]], ends)]
    if any(s < 0 for s in sizes):
        raise ValueError(f"offsets must be non-decreasing, got {ends}")
    return sizes


def check_gemm(
    where: str,
    kind: str,
    lhs: torch.Tensor,
    rhs: torch.Tensor,
    split_sizes: Sequence[int] | None,
    offsets: torch.Tensor,
    out: torch.Tensor | None,
    *,
    bias: torch.Tensor | None = None,
    lhs_name: str | None = None,
) -> tuple[int, int, int]:
    """Every check of one grouped GEMM; returns ``(groups, N, K)`` (the weight's, or wgrad's result shape).

    ``kind``: ``"fprop"`` (``lhs`` is ``x``, ``rhs`` the weight, ``bias`` allowed),
    ``"dgrad"`` (``lhs`` is ``grad_out``, named ``lhs_name`` when given, ``rhs`` the weight)
    or ``"wgrad"`` (``lhs`` is ``grad_out``, ``rhs`` is ``x``).
    """
    name = lhs_name or ("x" if kind == "fprop" else "grad_out")
    rhs_name = "x" if kind == "wgrad" else "weight"
    groups = check_operands(where, lhs, rhs, split_sizes, offsets, lhs_name=name, rhs_name=rhs_name)
    if kind == "wgrad":
        if rhs.dim() != 2 or rhs.shape[0] != lhs.shape[0]:
            raise ValueError(
                f"{where}: x must be [{lhs.shape[0]}, in] like grad_out's rows, got {tuple(rhs.shape)}"
            )
        dims = result = (groups, lhs.shape[1], rhs.shape[1])
    else:
        check_weight(where, rhs, groups)
        dims = (groups, rhs.shape[1], rhs.shape[2])
        inner, outer = (dims[2], dims[1]) if kind == "fprop" else (dims[1], dims[2])
        if lhs.shape[1] != inner:
            weight_side = f"expects {inner}" if kind == "fprop" else f"has {inner} outputs"
            raise ValueError(f"{where}: {name} has {lhs.shape[1]} features but weight {weight_side}")
        if bias is not None:
            check_bias(where, bias, groups, dims[1], lhs.dtype)
        result = (lhs.shape[0], outer)
    if out is not None:
        check_out(where, out, result, lhs.dtype, lhs.device)
    return dims


def check_fc2_dgrad_act(
    where: str,
    grad_y: torch.Tensor,
    weight: torch.Tensor,
    pre: torch.Tensor,
    split_sizes: list[int] | None,
    offsets: torch.Tensor,
    activation: ActivationSpec,
) -> tuple[int, int, int]:
    """Every check of ``fc2_dgrad_act`` but the scales'; returns ``(groups, H, N_act)`` of FC2's weight."""
    dims = check_gemm(where, "dgrad", grad_y, weight, split_sizes, offsets, None, lhs_name="grad_y")
    rows, n_act = grad_y.shape[0], weight.shape[2]
    if pre.dim() != 2 or pre.shape[0] != rows:
        raise ValueError(f"{where}: pre must be [{rows}, N_pre], got {tuple(pre.shape)}")
    if pre.dtype != grad_y.dtype:
        raise TypeError(f"{where}: pre dtype {pre.dtype} != grad_y dtype {grad_y.dtype}")
    if pre.device != grad_y.device:
        raise ValueError(f"{where}: pre is on {pre.device} but grad_y is on {grad_y.device}")
    activation.check_width(where, pre.shape[1])
    if activation.output_features(pre.shape[1]) != n_act:
        raise ValueError(
            f"{where}: {activation.kind} of pre with {pre.shape[1]} features gives "
            f"{activation.output_features(pre.shape[1])}, but weight expects {n_act}"
        )
    return dims


def check_row_scales(where: str, scales: object, rows: int, device: torch.device) -> torch.Tensor:
    """One floating value per token row, on ``device``; returned flattened to ``[rows]``.

    The one check of per-row scales: the scaled ops and ``Scale`` (any shape with ``rows``
    values) and the backends' ``fc1_fprop_act``/``fc2_dgrad_act`` (``[M]`` or ``[M, 1]``).
    """
    if not isinstance(scales, torch.Tensor):
        raise ValueError(f"{where}: scales must be a torch.Tensor, got {type(scales).__name__}")
    if not scales.dtype.is_floating_point:
        raise ValueError(f"{where}: scales must be floating point, got {scales.dtype}")
    if scales.numel() != rows:
        raise ValueError(
            f"{where}: scales has {scales.numel()} values (shape {list(scales.shape)}); "
            f"expected one per token row ({rows})"
        )
    if scales.device != device:
        raise ValueError(f"{where}: scales are on {scales.device} but the input is on {device}")
    return as_flat(scales)
