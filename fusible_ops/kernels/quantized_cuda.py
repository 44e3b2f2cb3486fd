"""Quantized GEMMs on CUDA through ``torch.nn.functional.scaled_grouped_mm``.

Rowwise FP8 (SM90 and newer): fprop and dgrad run as one ``scaled_grouped_mm`` call over
every group (``offs`` = the device offsets, no host sync), FP8 E4M3 data, one fp32
scale per row of ``a`` and per group and column of ``b``, bfloat16 output. The
weight-gradient GEMM, whose groups lie along the contraction dim, runs in the
emulation (dequantized fp32 grouped GEMM). Other recipes use the emulation on CUDA;
the plan says why. This path has not run on a GPU yet (``benchmarks/gpu_check.sh``
checks it against the emulation).
"""

from __future__ import annotations

import torch

from ..recipes.quantize import QuantizedOperand
from ..recipes.recipes import Float8Rowwise, Recipe
from . import quantized_cpu

Tensor = torch.Tensor


def scaled_grouped_mm_reason(recipe: Recipe, device: torch.device, dtype: torch.dtype) -> str | None:
    """None when :func:`grouped_fprop` / :func:`grouped_dgrad` can run here, else why not."""
    if device.type != "cuda":
        return "needs a CUDA device"
    if not hasattr(torch.nn.functional, "scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_grouped_mm"
    if type(recipe) is not Float8Rowwise:
        return f"only the rowwise recipe is wired to scaled_grouped_mm, not {recipe.name}"
    if dtype != torch.bfloat16:
        return f"scaled_grouped_mm writes bfloat16 results; {dtype} inputs use the emulation"
    major, _ = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"rowwise scaled_grouped_mm needs SM90 or newer, this GPU is sm_{major}x"
    return None


def _call(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, offsets: Tensor) -> Tensor:
    from torch.nn.functional import ScalingType

    return torch.nn.functional.scaled_grouped_mm(
        a,
        b,
        scale_a.contiguous(),
        ScalingType.RowWise,
        scale_b.contiguous(),
        ScalingType.RowWise,
        offs=offsets.to(torch.int32),
        output_dtype=torch.bfloat16,
    )


def grouped_fprop(choice, x: QuantizedOperand, weight: QuantizedOperand, splits, bias) -> Tensor:
    groups, n, _ = weight.shape
    w = weight.data.view(weight.shape)
    scale_b = weight.scale_inv[:, 0].view(groups, n)
    y = _call(x.data, w.transpose(-2, -1), x.scale_inv[:, 0], scale_b, splits.offsets).float()
    if bias is not None:
        from .base import group_ids_from_offsets

        ids = group_ids_from_offsets(splits.offsets, y.shape[0]).clamp(max=groups - 1)
        y.add_(bias.float().index_select(0, ids))
    return y


def grouped_dgrad(choice, grad_out: QuantizedOperand, weight: QuantizedOperand, splits) -> Tensor:
    groups = weight.shape[0]
    w = weight.data.view(weight.shape)  # [G, N, K] as b: each group column-major
    b = w.transpose(-2, -1).contiguous().transpose(-2, -1)
    scale_b = weight.scale_inv[:groups]  # [G, K]: one scale per group and input feature
    return _call(grad_out.data, b, grad_out.scale_inv[:, 0], scale_b, splits.offsets).float()


def grouped_wgrad(choice, grad_out: QuantizedOperand, x: QuantizedOperand, splits) -> Tensor:
    return quantized_cpu.kernel_ops.wgrad(choice.fp32.backend, grad_out.dequantize(), x.dequantize(), splits)


def dense_fprop(choice, x, weight, bias):
    return quantized_cpu.dense_fprop(choice, x, weight, bias)


def dense_dgrad(choice, grad_out, weight):
    return quantized_cpu.dense_dgrad(choice, grad_out, weight)


def dense_wgrad(choice, grad_out, x):
    return quantized_cpu.dense_wgrad(choice, grad_out, x)
