"""What GroupedLinear and BasicLinear compute under a low-precision recipe.

Forward ``y = x @ W^T``: ``x`` and ``W`` quantized along in-features. Backward: dgrad
``dx = dy @ W`` with ``dy`` and ``W`` quantized along out-features; wgrad
``dW = dy^T @ x`` with both quantized along the token rows of each group (unless the
recipe keeps wgrad in high precision). GEMMs accumulate in fp32; results come back
in the input's dtype, weight gradients in the parameter's dtype. Saved for backward:
the along-rows quantized copy of ``x`` (what wgrad reads) instead of ``x``; the
weight's quantized copies come from the per-parameter cache.
"""

from __future__ import annotations

import torch

from ..core.dtypes import cast
from ..core.op import OpBackward, OperationContext
from ..core.splits import SplitInfo
from ..kernels import library as kernel_ops
from ..kernels import quantized as qkernels
from ..kernels.quantized import QuantizedChoice
from ..recipes.quantize import QuantizedOperand, check_quantizable, check_quantized_input, quantize_rows
from ..recipes.recipes import ALONG_COLUMNS, ALONG_ROWS
from ..recipes.weight_cache import quantized_weight

Tensor = torch.Tensor


def save_wgrad_input(ctx: OperationContext, choice: QuantizedChoice, x: Tensor, group_ends) -> dict:
    """What wgrad needs of the GEMM's input ``x`` ``[M, K]``: its along-rows quantized copy
    (layout kept on ``ctx.x_layout``), or ``x`` itself when wgrad runs in high precision."""
    if "wgrad" not in choice.recipe.quantized_gemms():
        return {"x": x, "x_data": None, "x_scale": None, "x_tiles": None}
    x_rows = quantize_rows(x, choice.recipe, "input", ALONG_ROWS, group_ends)
    ctx.x_layout = x_rows.layout()
    return {"x": None, **x_rows.to_save("x")}


def fc_input(
    op_name: str, x: Tensor, recipe, splits: SplitInfo, x_q: QuantizedOperand | None
) -> QuantizedOperand:
    """The forward GEMM's quantized input: the caller's ``x_q`` once checked, or ``x``
    quantized along its columns."""
    if x_q is None:
        return quantize_rows(x, recipe, "input", ALONG_COLUMNS, splits.offsets)
    check_quantized_input(op_name, x_q, recipe, x, splits.offsets)
    return x_q


def saved_wgrad_input(ctx: OperationContext) -> Tensor | QuantizedOperand:
    saved = ctx.saved
    if saved["x"] is not None:
        return saved["x"]
    return QuantizedOperand.from_saved(saved, "x", ctx.x_layout)


def grouped_wgrad(choice: QuantizedChoice, quantized: bool, grad_out: Tensor, x, splits: SplitInfo) -> Tensor:
    """``[G, N, K]``: quantized along rows (fp32 result), or the high-precision grouped wgrad."""
    if not quantized:
        return kernel_ops.wgrad(choice.backend, grad_out, x, splits)
    grad_rows = quantize_rows(grad_out, choice.recipe, "grad", ALONG_ROWS, splits.offsets)
    if not isinstance(x, QuantizedOperand):
        x = quantize_rows(x, choice.recipe, "input", ALONG_ROWS, splits.offsets)
    return qkernels.wgrad(choice, grad_rows, x, splits)


# ---------------------------------------------------------------- GroupedLinear


def grouped_forward(
    op,
    ctx: OperationContext,
    choice: QuantizedChoice,
    x: Tensor,
    weight_param: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    splits: SplitInfo,
    out: Tensor | None,
    x_q: QuantizedOperand | None = None,
) -> Tensor:
    """``x`` ``[M, K]``, ``weight`` ``[G, N, K]`` (a view of ``weight_param``) -> ``[M, N]``;
    ``x_q``: ``x`` already quantized by the caller (checked here, before any write)."""
    recipe = choice.recipe
    check_quantizable(op.op_name(), x.dtype, recipe)
    x_q = fc_input(op.op_name(), x, recipe, splits, x_q)
    w_q = quantized_weight(weight_param, weight, recipe, ALONG_COLUMNS)
    y = qkernels.fprop(choice, x_q, w_q, splits, bias, out, x.dtype)
    if ctx.requires_grad:
        saved = {"x": None, "x_data": None, "x_scale": None, "x_tiles": None}
        if ctx.needs_param_grad("weight"):
            saved = save_wgrad_input(ctx, choice, x, splits.offsets)
        ctx.save_for_backward(**saved, offsets=splits.offsets, host_sizes=splits.host_sizes)
        ctx.quantized = choice
        ctx.backend = choice.backend
        ctx.host_splits = splits.host
        ctx.compute_dtype = x.dtype
    return y


def grouped_backward(op, ctx: OperationContext, grad_output: Tensor) -> OpBackward:
    choice: QuantizedChoice = ctx.quantized
    recipe = choice.recipe
    saved = ctx.saved
    weight_param, bias_param = ctx.params["weight"], ctx.params["bias"]
    splits = SplitInfo(ctx.host_splits, saved["offsets"], saved["host_sizes"])
    dtype = ctx.compute_dtype
    dy = cast(grad_output.reshape(-1, op.out_features), dtype).contiguous()
    grad_input = None
    if ctx.input_requires_grad:
        from ..core.buffers import buffer_rows

        out = buffer_rows(ctx.grad_input_buffer, dy.shape[0], op.in_features)
        weight = cast(op.weight_out_in(weight_param), dtype)
        dy_q = quantize_rows(dy, recipe, "grad", ALONG_COLUMNS, splits.offsets)
        w_q = quantized_weight(weight_param, weight, recipe, ALONG_ROWS)
        grad_input = qkernels.dgrad(choice, dy_q, w_q, splits, out, dtype).view(ctx.input_shape)
    grad_weight = grad_bias = None
    if ctx.needs_param_grad("weight"):
        x = saved_wgrad_input(ctx)
        if isinstance(x, QuantizedOperand):
            dy_rows = quantize_rows(dy, recipe, "grad", ALONG_ROWS, splits.offsets)
            grad_weight = op.weight_out_in(qkernels.wgrad(choice, dy_rows, x, splits))
        else:
            lhs, rhs = (dy, x) if op.weight_layout == "out_in" else (x, dy)
            grad_weight = kernel_ops.wgrad(choice.backend, lhs, rhs, splits)
        grad_weight = cast(grad_weight, weight_param.dtype)
    if ctx.needs_param_grad("bias"):
        grad_bias = cast(kernel_ops.bias_grad(choice.backend, dy, splits, op.num_groups), bias_param.dtype)
    params = [grad_weight] if bias_param is None else [grad_weight, grad_bias]
    return OpBackward(grad_input, params, (None,))


# ---------------------------------------------------------------- BasicLinear


def linear_forward(
    ctx: OperationContext, linear, choice: QuantizedChoice, x: Tensor, weight: Tensor, bias: Tensor | None
) -> Tensor:
    """``x`` ``[..., K]``, ``weight`` ``[N, K]`` (already in the compute dtype; a rank's
    shard under tensor parallelism) -> ``[..., N]``."""
    recipe = choice.recipe
    check_quantizable(linear.op_name(), x.dtype, recipe)
    x2d = x.reshape(-1, weight.shape[1])
    x_q = quantize_rows(x2d, recipe, "input", ALONG_COLUMNS, None)
    w_q = quantized_weight(ctx.params["weight"], weight, recipe, ALONG_COLUMNS)
    y = qkernels.linear_fprop(choice, x_q, w_q, bias, x.dtype)
    if ctx.requires_grad:
        saved = {"x": None, "x_data": None, "x_scale": None, "x_tiles": None}
        if ctx.needs_param_grad("weight"):
            saved = save_wgrad_input(ctx, choice, x2d, None)
        ctx.save_for_backward(**saved)
        ctx.quantized = choice
        ctx.compute_dtype = x.dtype
        ctx.input_shape = x.shape
    return y.view(*x.shape[:-1], weight.shape[0])


def linear_backward(
    linear, ctx: OperationContext, grad_output: Tensor, weight_param: Tensor | None = None
) -> OpBackward:
    """``weight_param``: the weight (a rank's shard under tensor parallelism); default the
    op's parameter."""
    choice: QuantizedChoice = ctx.quantized
    recipe = choice.recipe
    weight_param = ctx.params["weight"] if weight_param is None else weight_param
    dtype = ctx.compute_dtype
    dy = cast(grad_output, dtype).reshape(-1, weight_param.shape[0]).contiguous()
    grad_input = grad_weight = None
    if ctx.input_requires_grad:
        dy_q = quantize_rows(dy, recipe, "grad", ALONG_COLUMNS, None)
        w_q = quantized_weight(weight_param, cast(weight_param, dtype), recipe, ALONG_ROWS)
        grad_input = qkernels.linear_dgrad(choice, dy_q, w_q, dtype).view(ctx.input_shape)
    if ctx.needs_param_grad("weight"):
        x = saved_wgrad_input(ctx)
        if isinstance(x, QuantizedOperand):
            dy_rows = quantize_rows(dy, recipe, "grad", ALONG_ROWS, None)
            grad_weight = qkernels.linear_wgrad(choice, dy_rows, x)
        else:
            grad_weight = dy.t() @ x
        grad_weight = cast(grad_weight, weight_param.dtype)
    return OpBackward(grad_input, [grad_weight])
