"""Ops that bring a tensor into the chain or hand one out of it."""

from __future__ import annotations

import torch

from ..core.op import BasicOperation, FusedBackward, FusedForward, OpBackward, OperationContext


class AddExtraInput(BasicOperation):
    """``y = x + extra`` with ``extra`` given as an extra input (e.g. a residual).

    Takes no constructor arguments.

    Shape:
        input: ``[*]``, any shape.
        extra: extra input, ``[*]``, the input's shape, dtype and device; its
            gradient is returned too.
        output: ``[*]``, same shape as the input.
    """

    num_extra_inputs = 1

    static_preflight = True  # value checks, if any, are in check_values

    def preflight(self, input_meta, extra_inputs, kwargs, *, guard):
        extra = extra_inputs[0]
        if not isinstance(extra, torch.Tensor) or tuple(extra.shape) != tuple(input_meta.shape):
            got = list(extra.shape) if isinstance(extra, torch.Tensor) else type(extra).__name__
            raise ValueError(
                f"AddExtraInput: extra input must be a tensor of shape {list(input_meta.shape)}, got {got}"
            )
        if extra.dtype != input_meta.dtype or extra.device != input_meta.device:
            raise ValueError(
                f"AddExtraInput: extra input is {extra.dtype} on {extra.device}; expected "
                f"{input_meta.dtype} on {input_meta.device} like the main input"
            )
        return input_meta

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        ctx.extra_requires_grad = extra.requires_grad
        return input_ + extra

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor) -> OpBackward:
        return OpBackward(grad_output, (), (grad_output if ctx.extra_requires_grad else None,))


class MakeExtraOutput(BasicOperation):
    """``y = x``, also handed out as an extra output of the :class:`~fusible_ops.Sequential`.

    Takes no constructor arguments. The Sequential then returns ``(output,
    *extra_outputs)`` with this op's input among the extra outputs, in op order; in
    backward, the gradient of the extra output is added to the input's gradient.

    Shape:
        input: ``[*]``, any shape.
        output: ``[*]``, the input itself.
        extra output: ``[*]``, the input itself.
    """

    num_extra_outputs = 1

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs) -> FusedForward:
        return FusedForward(input_, [(input_,)])

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs) -> FusedBackward:
        (grad_extra,) = basic_op_grad_extra_outputs[0]
        grad_input = grad_output if grad_extra is None else grad_output + grad_extra
        return FusedBackward(grad_input, [[]], [()])
