"""Scaling ops: a constant factor, or one factor per token row from an extra input."""

from __future__ import annotations

import torch

from ..core.op import BasicOperation, OpBackward, OperationContext
from ..kernels.activation import row_dot
from ..kernels.signature_checks import signature_fixes_kernel_args
from .scaled_activations import check_op_row_scales


class ConstantScale(BasicOperation):
    """``y = scale * x`` with a constant factor.

    Args:
        scale: the factor, converted to a Python float (not a parameter).

    Shape:
        input: ``[*]``, any shape.
        output: ``[*]``, same shape as the input.
    """

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = float(scale)

    def extra_repr(self) -> str:
        return f"scale={self.scale}"

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor) -> torch.Tensor:
        return input_ * self.scale

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor) -> OpBackward:
        return OpBackward(grad_output * self.scale)


@signature_fixes_kernel_args
class Scale(BasicOperation):
    """``y = x * scales[:, None]`` with ``scales`` (one value per token row) as extra input.

    Takes no constructor arguments. In an MoE expert block it applies the routing
    weights after fc2 (``fo.MoE(..., scale_after_fc2=True)``).

    Shape:
        input: ``[..., n]``.
        scales: extra input, one value per token row (``prod(input.shape[:-1])``
            values, e.g. ``[rows]`` or ``[rows, 1]``), any floating dtype, on the input's
            device; its gradient is returned too.
        output: ``[..., n]``, the input's dtype.
    """

    num_extra_inputs = 1

    static_preflight = True  # value checks, if any, are in check_values

    def compile_facts(self) -> tuple:
        return ()

    def preflight(self, input_meta, extra_inputs, kwargs, *, guard):
        check_op_row_scales(self.op_name(), extra_inputs[0], input_meta)
        return input_meta

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        x = input_.reshape(-1, input_.shape[-1])
        flat_scales = scales.reshape(-1)
        if ctx.requires_grad:
            ctx.save_for_backward(input=x if scales.requires_grad else None, scales=flat_scales)
            ctx.input_shape = input_.shape
            ctx.scales_shape = scales.shape
            ctx.scales_requires_grad = scales.requires_grad
        return (x * flat_scales.to(x.dtype).unsqueeze(-1)).view(input_.shape)

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor) -> OpBackward:
        dy = grad_output.reshape(-1, grad_output.shape[-1])
        scales = ctx.saved["scales"]
        grad_input = (dy * scales.to(dy.dtype).unsqueeze(-1)).view(ctx.input_shape)
        grad_scales = None
        if ctx.scales_requires_grad:
            x = ctx.saved["input"]
            grad_scales = row_dot(x, dy, scales.dtype).view(ctx.scales_shape)
        return OpBackward(grad_input, (), (grad_scales,))
