"""Ops that only pass data through or change its shape."""

from __future__ import annotations

import math

import torch

from ..core.op import BasicOperation, OpBackward, OperationContext, TensorMeta


class Identity(BasicOperation):
    """``y = x``: passes its input on unchanged.

    Shape:
        input: ``[*]``, any shape.
        output: ``[*]``, the input itself.
    """

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor) -> torch.Tensor:
        return input_

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor) -> OpBackward:
        return OpBackward(grad_output)


class Reshape(BasicOperation):
    """``y = x.reshape(shape)``: the whole tensor, leading dims included.

    Args:
        shape: the output shape, a tuple or list of ints; one entry may be ``-1``
            (inferred from the input's number of elements).

    Shape:
        input: ``[*]``, any shape with as many elements as ``shape`` allows.
        output: ``shape``, with the ``-1`` entry filled in.
    """

    def __init__(self, shape: tuple[int, ...] | list[int]) -> None:
        super().__init__()
        self.shape = tuple(int(s) for s in shape)

    def extra_repr(self) -> str:
        return f"shape={self.shape}"

    static_preflight = True  # value checks, if any, are in check_values

    def preflight(self, input_meta, extra_inputs, kwargs, *, guard):
        numel = math.prod(input_meta.shape)
        known = math.prod(s for s in self.shape if s != -1)
        shape = self.shape
        if -1 in shape and known:
            shape = tuple(numel // known if s == -1 else s for s in shape)
        if math.prod(shape) != numel or (-1 in self.shape and known and numel % known):
            raise ValueError(
                f"Reshape: cannot reshape input of shape {list(input_meta.shape)} to {list(self.shape)}"
            )
        return TensorMeta(shape, input_meta.dtype, input_meta.device)

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor) -> torch.Tensor:
        ctx.input_shape = input_.shape
        return input_.reshape(self.shape)

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor) -> OpBackward:
        return OpBackward(grad_output.reshape(ctx.input_shape))
