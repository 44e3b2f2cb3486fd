"""What the fused GroupedMLP computes under a low-precision recipe.

The same math as the unfused quantized ops (see :mod:`fusible_ops.basic.quantized_linear`):
fc1 on ``x`` and ``W1`` quantized along in-features; the (probability-scaled) activation
in the input's dtype; fc2 on that activation output, quantized once along its features,
and ``W2``. Backward quantizes ``dy`` (or, with Scale after fc2, ``dy * scales``) and
``grad_pre`` along the out-features of their GEMMs for dgrad and along the token rows
of each group for wgrad; fc2's input is recomputed from ``pre`` and quantized along
rows. Saved: ``x``'s along-rows quantized copy (not ``x``), ``pre``, the scales and, with
Scale after fc2, fc2's output (what the scales' gradient needs, as unfused Scale saves).
"""

from __future__ import annotations

import torch

from ..basic.quantized_linear import fc_input, grouped_wgrad, save_wgrad_input, saved_wgrad_input
from ..core.splits import SplitInfo
from ..kernels import library as kernel_ops
from ..kernels import quantized as qkernels
from ..kernels.activation import activation_backward, activation_forward, row_dot
from ..kernels.quantized import QuantizedChoice
from ..recipes.quantize import check_quantizable, quantize_rows
from ..recipes.recipes import ALONG_COLUMNS, ALONG_ROWS
from ..recipes.weight_cache import quantized_weight

Tensor = torch.Tensor


def mlp_forward(
    mlp,
    ctx1,
    choice: QuantizedChoice,
    x: Tensor,
    weights: tuple[Tensor, Tensor, Tensor, Tensor],
    b1: Tensor | None,
    b2: Tensor | None,
    scales: Tensor,
    splits: SplitInfo,
    out: Tensor | None,
    save: bool,
    x_q=None,
) -> Tensor:
    """``y`` ``[M, H]``; ``weights``: ``(w1 param, w1 [G, N1, K], w2 param, w2 [G, H, F])``;
    ``x_q``: fc1's input already quantized by the caller (checked before any write)."""
    recipe, dtype, ends = choice.recipe, x.dtype, splits.offsets
    check_quantizable(mlp.fc1.op_name(), dtype, recipe)
    w1_param, w1, w2_param, w2 = weights
    x_q = fc_input(mlp.fc1.op_name(), x, recipe, splits, x_q)
    pre = qkernels.fprop(
        choice, x_q, quantized_weight(w1_param, w1, recipe, ALONG_COLUMNS), splits, b1, None, dtype
    )
    act = activation_forward(mlp.spec, pre)
    scale_col = scales.to(dtype).unsqueeze(-1)
    fc2_in = act if mlp.scale_after_fc2 else act * scale_col
    fc2_q = quantize_rows(fc2_in, recipe, "input", ALONG_COLUMNS, ends)  # quantized once
    w2_q = quantized_weight(w2_param, w2, recipe, ALONG_COLUMNS)
    z = None
    if mlp.scale_after_fc2:
        z = qkernels.fprop(choice, fc2_q, w2_q, splits, b2, None, dtype)
        y = torch.mul(z, scale_col, out=out) if out is not None else z * scale_col
    else:
        y = qkernels.fprop(choice, fc2_q, w2_q, splits, b2, out, dtype)
    if save:
        saved = {"x": None, "x_data": None, "x_scale": None, "x_tiles": None}
        if ctx1.needs_param_grad("weight"):
            saved = save_wgrad_input(ctx1, choice, x, ends)
        ctx1.save_for_backward(
            **saved, pre=pre, z=z, scales=scales, offsets=splits.offsets, host_sizes=splits.host_sizes
        )
    return y


def mlp_backward(mlp, ctx1, choice: QuantizedChoice, dy: Tensor, weights, needs, grad_input_out) -> tuple:
    """``(grad_input, grad_w1, grad_b1, grad_w2, grad_b2, grad_scales)``, weight gradients
    ``[G, N, K]`` in the compute dtype; None where not needed."""
    need_input, need_w1, need_b1, need_w2, need_b2, need_scales = needs
    recipe, dtype, saved = choice.recipe, dy.dtype, ctx1.saved
    splits = SplitInfo(ctx1.host_splits, saved["offsets"], saved["host_sizes"])
    ends, groups, spec = splits.offsets, mlp.fc1.num_groups, mlp.spec
    w1_param, w1, w2_param, w2 = weights
    pre, scales = saved["pre"], saved["scales"]
    scale_col = scales.to(dtype).unsqueeze(-1)
    act = activation_forward(spec, pre)
    grad_scales = None
    if mlp.scale_after_fc2:
        d_z, fc2_in = dy * scale_col, act
        if need_scales:
            grad_scales = row_dot(saved["z"], dy, scales.dtype)
    else:
        d_z, fc2_in = dy, act * scale_col
    d_z_q = quantize_rows(d_z, recipe, "grad", ALONG_COLUMNS, ends)
    grad_fc2_in = qkernels.dgrad(
        choice, d_z_q, quantized_weight(w2_param, w2, recipe, ALONG_ROWS), splits, None, dtype
    )
    if mlp.scale_after_fc2:
        grad_act = grad_fc2_in
    else:
        if need_scales:
            grad_scales = row_dot(act, grad_fc2_in, scales.dtype)
        grad_act = grad_fc2_in * scale_col
    grad_pre = activation_backward(spec, pre, grad_act)
    quantized_wgrad = "wgrad" in recipe.quantized_gemms()
    grad_w2 = grad_w1 = None
    if need_w2:
        grad_w2 = grouped_wgrad(choice, quantized_wgrad, d_z, fc2_in, splits)
    grad_b2 = kernel_ops.bias_grad(choice.backend, d_z, splits, groups) if need_b2 else None
    grad_input = None
    if need_input:
        grad_pre_q = quantize_rows(grad_pre, recipe, "grad", ALONG_COLUMNS, ends)
        w1_q = quantized_weight(w1_param, w1, recipe, ALONG_ROWS)
        grad_input = qkernels.dgrad(choice, grad_pre_q, w1_q, splits, grad_input_out, dtype)
    if need_w1:
        x = saved_wgrad_input(ctx1)
        grad_w1 = grouped_wgrad(choice, quantized_wgrad, grad_pre, x, splits)
    grad_b1 = kernel_ops.bias_grad(choice.backend, grad_pre, splits, groups) if need_b1 else None
    return grad_input, grad_w1, grad_b1, grad_w2, grad_b2, grad_scales
