"""Quantized GEMM engines that run anywhere torch runs: the emulation and ``scaled_mm``.

- **Emulation** (``engine="emulation"``): each operand is dequantized to fp32 (FP8 value
  times its tile's scale, exact) and the GEMM runs in fp32 on the grouped backend chosen
  for fp32 (``torch.mm`` for dense ops). This is the reference semantics of every recipe.
- **scaled_mm** (``engine="scaled_mm"``, CPU, tensorwise and rowwise): one
  ``torch._scaled_mm`` per non-empty group on the FP8 data with the group's scales
  (a scalar per operand, or a scale per row of ``a`` and per column of ``b``), fp32
  output. It needs the split sizes on the host.
"""

from __future__ import annotations

import torch

from ..core.splits import SplitInfo
from ..recipes.quantize import QuantizedOperand
from ..recipes.recipes import Float8Tensorwise
from . import library as kernel_ops
from .grouped_checks import host_split_sizes

Tensor = torch.Tensor


def _dequantized(operand: QuantizedOperand) -> Tensor:
    return operand.dequantize()


# ---------------------------------------------------------------- emulation / scaled_mm: grouped


def grouped_fprop(choice, x: QuantizedOperand, weight: QuantizedOperand, splits: SplitInfo, bias) -> Tensor:
    """fp32 ``[M, N]``."""
    bias32 = None if bias is None else bias.float()
    if choice.engine == "scaled_mm":
        return _scaled_mm_groups(choice, "fprop", x, weight, splits, bias32)
    return kernel_ops.fprop(choice.fp32.backend, _dequantized(x), _dequantized(weight), splits, bias=bias32)


def grouped_dgrad(choice, grad_out: QuantizedOperand, weight: QuantizedOperand, splits: SplitInfo) -> Tensor:
    """fp32 ``[M, K]``."""
    if choice.engine == "scaled_mm":
        return _scaled_mm_groups(choice, "dgrad", grad_out, weight, splits, None)
    return kernel_ops.dgrad(choice.fp32.backend, _dequantized(grad_out), _dequantized(weight), splits)


def grouped_wgrad(choice, grad_out: QuantizedOperand, x: QuantizedOperand, splits: SplitInfo) -> Tensor:
    """fp32 ``[G, N, K]``."""
    if choice.engine == "scaled_mm":
        return _scaled_mm_groups(choice, "wgrad", grad_out, x, splits, None)
    return kernel_ops.wgrad(choice.fp32.backend, _dequantized(grad_out), _dequantized(x), splits)


# ---------------------------------------------------------------- dense


def dense_fprop(choice, x: QuantizedOperand, weight: QuantizedOperand, bias) -> Tensor:
    if choice.engine == "scaled_mm":
        out = _scaled_mm(x.data, weight.data.t(), _rows(x, 0, x.data.shape[0]), _cols(weight, 0))
    else:
        out = torch.mm(_dequantized(x), _dequantized(weight).t())
    return out if bias is None else out.add_(bias.float())


def dense_dgrad(choice, grad_out: QuantizedOperand, weight: QuantizedOperand) -> Tensor:
    if choice.engine == "scaled_mm":
        b = weight.data.t().contiguous().t()
        return _scaled_mm(
            grad_out.data, b, _rows(grad_out, 0, grad_out.data.shape[0]), _group_cols(weight, 0)
        )
    return torch.mm(_dequantized(grad_out), _dequantized(weight))


def dense_wgrad(choice, grad_out: QuantizedOperand, x: QuantizedOperand) -> Tensor:
    if choice.engine == "scaled_mm":
        a = grad_out.data.t().contiguous()
        b = x.data.t().contiguous().t()
        return _scaled_mm(a, b, _group_cols(grad_out, 0).t(), _group_cols(x, 0))
    return torch.mm(_dequantized(grad_out).t(), _dequantized(x))


# ---------------------------------------------------------------- scaled_mm pieces


def _scaled_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor) -> Tensor:
    """``(a * scale_a) @ (b * scale_b)`` in fp32: ``a`` row-major FP8, ``b`` column-major FP8."""
    return torch._scaled_mm(a, b, _dense_scale(scale_a), _dense_scale(scale_b), out_dtype=torch.float32)


def _dense_scale(scale: Tensor) -> Tensor:
    """``scale`` with unit strides (``contiguous()`` keeps a size-1 dim's stride, which
    ``_scaled_mm`` checks)."""
    return scale.flatten().clone().view(scale.shape)


def _is_tensorwise(operand: QuantizedOperand) -> bool:
    return operand.col_block is None and operand.scale_inv.shape[1] == 1 and operand.row_tiles is not None


def _rows(operand: QuantizedOperand, group: int, rows: int, start: int = 0) -> Tensor:
    """Scale of ``a`` for rows ``start:start+rows``: ``[rows, 1]`` (rowwise) or a scalar (tensorwise)."""
    if _is_tensorwise(operand):
        return operand.scale_inv[group, 0]
    return operand.scale_inv[start : start + rows]


def _cols(weight: QuantizedOperand, group: int) -> Tensor:
    """Scale of ``b = weight[group]^T`` (fprop): ``[1, N]`` per output row, or a scalar."""
    n = weight.shape[-2]
    if _is_tensorwise(weight):
        return weight.scale_inv[group, 0]
    return weight.scale_inv[group * n : (group + 1) * n].t()


def _group_cols(operand: QuantizedOperand, group: int) -> Tensor:
    """Scale of an operand quantized along the rows of ``group`` as ``b``: ``[1, C]``, or a scalar."""
    if _is_tensorwise(operand):
        return operand.scale_inv[group, 0]
    return operand.scale_inv[group : group + 1]


def _scaled_mm_groups(
    choice, gemm: str, lhs: QuantizedOperand, rhs: QuantizedOperand, splits, bias
) -> Tensor:
    sizes = splits.host
    if sizes is None:
        if splits.offsets.device.type != "cpu" or torch.compiler.is_compiling():
            raise RuntimeError(
                f"quantized {gemm} (scaled_mm engine): the per-group loop needs host split sizes; "
                "use the emulation engine (fusible_ops.quantized(recipe, backend='emulation'))"
            )
        sizes = host_split_sizes(None, splits.offsets)
    tensorwise = isinstance(choice.recipe, Float8Tensorwise)
    groups = len(sizes)
    if gemm == "wgrad":
        n, k = lhs.data.shape[1], rhs.data.shape[1]
        out = lhs.data.new_zeros((groups, n, k), dtype=torch.float32)
    elif gemm == "fprop":
        out = lhs.data.new_zeros((lhs.data.shape[0], rhs.shape[-2]), dtype=torch.float32)
    else:
        out = lhs.data.new_zeros((lhs.data.shape[0], rhs.shape[-1]), dtype=torch.float32)
    weight = rhs.data.view(rhs.shape) if gemm != "wgrad" else None
    start = 0
    for g, size in enumerate(sizes):
        end = start + size
        if size:
            if gemm == "fprop":
                a_scale = lhs.scale_inv[g, 0] if tensorwise else lhs.scale_inv[start:end]
                result = _scaled_mm(lhs.data[start:end], weight[g].t(), a_scale, _cols(rhs, g))
                out[start:end] = result if bias is None else result + bias[g]
            elif gemm == "dgrad":
                a_scale = lhs.scale_inv[g, 0] if tensorwise else lhs.scale_inv[start:end]
                b = weight[g].t().contiguous().t()
                out[start:end] = _scaled_mm(lhs.data[start:end], b, a_scale, _group_cols(rhs, g))
            else:
                a = lhs.data[start:end].t().contiguous()
                b = rhs.data[start:end].t().contiguous().t()
                a_scale = _group_cols(lhs, g)
                out[g] = _scaled_mm(a, b, a_scale if tensorwise else a_scale.t(), _group_cols(rhs, g))
        start = end
    return out
