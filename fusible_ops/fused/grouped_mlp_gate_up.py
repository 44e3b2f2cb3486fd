"""What the fused GroupedMLP computes when fc1 keeps its gate and up weights apart
(:class:`~fusible_ops.GroupedGateUpLinear`).

fc1 is two grouped GEMMs, ``gate = x @ Wg^T`` and ``up = x @ Wu^T``, that are never
concatenated; the gated activation reads the two halves directly, scaled by the routing
weights before fc2, after fc2 (with ``Scale``), or not at all (a block whose routing
weights are applied by the caller, as torchtitan's combine does). The GEMMs run on the
backend's grouped GEMMs, or quantized under a recipe (see
:mod:`fusible_ops.basic.gate_up_gemms`: fc2's input quantized once); the activation is one
separate elementwise pass. Saved for backward: what fc1's weight gradients need of ``x``
(``x``, or its along-rows quantized copy), ``gate``, ``up``, the scales, and with Scale
after fc2 that needs its gradient, fc2's unscaled output.
"""

from __future__ import annotations

import torch

from ..basic.gate_up_gemms import SAVED_INPUT_NAMES, PlainGemms
from ..core.splits import SplitInfo
from ..kernels import library as kernel_ops
from ..kernels.activation import gated_backward, gated_forward, row_dot

Tensor = torch.Tensor


def mlp_forward(
    mlp, ctx1, gemms: PlainGemms, x: Tensor, weights: tuple, b2, scales, splits: SplitInfo, out, save: bool
) -> Tensor:
    """``y`` ``[M, H]``; ``weights``: ``(gate [G, F, K], up [G, F, K], w2 [G, H, F])``."""
    w_gate, w_up, w2 = weights
    gate, up = gemms.fc1(x, (w_gate, w_up), splits)
    act = gated_forward(mlp.spec, gate, up)
    scale_col = None if scales is None else scales.to(x.dtype).unsqueeze(-1)
    z = None
    if scale_col is None:
        y = gemms.fc2(act, w2, splits, b2, out)
    elif mlp.scale_after_fc2:
        z = gemms.fc2(act, w2, splits, b2, None)
        y = torch.mul(z, scale_col, out=out) if out is not None else z * scale_col
    else:
        y = gemms.fc2(act * scale_col, w2, splits, b2, out)
    if save:
        saved_x = dict.fromkeys(SAVED_INPUT_NAMES)
        if ctx1.needs_param_grad("gate_weight") or ctx1.needs_param_grad("up_weight"):
            saved_x.update(gemms.save_input(ctx1, x, splits))
        keep_z = z is not None and scales.requires_grad
        ctx1.save_for_backward(
            **saved_x,
            gate=gate,
            up=up,
            z=z if keep_z else None,
            scales=scales,
            offsets=splits.offsets,
            host_sizes=splits.host_sizes,
        )
    return y


def mlp_backward(
    mlp, ctx1, gemms: PlainGemms, dy: Tensor, weights: tuple, needs: tuple, grad_input_out
) -> tuple:
    """``(grad_input, (grad_gate_w, grad_up_w), grad_w2 [G, H, F], grad_b2, grad_scales)``,
    None where not needed; ``needs``: input, gate and up weights, w2, b2, scales."""
    need_input, need_gate, need_up, need_w2, need_b2, need_scales = needs
    saved, spec = ctx1.saved, mlp.spec
    splits = SplitInfo(ctx1.host_splits, saved["offsets"], saved["host_sizes"])
    w_gate, w_up, w2 = weights
    gate, up, scales = saved["gate"], saved["up"], saved["scales"]
    act = gated_forward(spec, gate, up)
    scale_col = None if scales is None else scales.to(dy.dtype).unsqueeze(-1)
    grad_scales = None
    if scale_col is not None and mlp.scale_after_fc2:
        d_z, fc2_in = dy * scale_col, act
        if need_scales:
            grad_scales = row_dot(saved["z"], dy, scales.dtype)
    else:
        d_z, fc2_in = dy, act if scale_col is None else act * scale_col
    grad_act = gemms.fc2_dgrad(d_z, w2, splits)
    if scale_col is not None and not mlp.scale_after_fc2:
        if need_scales:
            grad_scales = row_dot(act, grad_act, scales.dtype)
        grad_act = grad_act * scale_col
    grad_gate, grad_up = gated_backward(spec, gate, up, grad_act)
    grad_w2 = gemms.wgrad(d_z, fc2_in, splits) if need_w2 else None
    grad_b2 = kernel_ops.bias_grad(gemms.backend, d_z, splits, w2.shape[0]) if need_b2 else None
    grad_input = None
    if need_input:
        grad_input = gemms.fc1_dgrad([grad_gate, grad_up], (w_gate, w_up), splits, grad_input_out)
    x = gemms.saved_input(ctx1) if need_gate or need_up else None
    grad_fc1 = tuple(
        gemms.wgrad(grad, x, splits) if need else None
        for grad, need in ((grad_gate, need_gate), (grad_up, need_up))
    )
    return grad_input, grad_fc1, grad_w2, grad_b2, grad_scales
