"""Dropout as a basic op."""

from __future__ import annotations

import torch

from ..core.op import BasicOperation, OpBackward, OperationContext


class Dropout(BasicOperation):
    """Zero each element with probability ``p`` and scale the rest by ``1 / (1 - p)``.

    Only in training mode; in eval mode (or with ``p=0``) it returns its input.

    Args:
        p: the probability of zeroing an element, in ``[0, 1)``. Default: 0.5.

    Shape:
        input: ``[*]``, any shape.
        output: ``[*]``, same shape as the input.

    Raises:
        ValueError: ``p`` outside ``[0, 1)``.
    """

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout: p must be in [0, 1), got {p}")
        self.p = float(p)

    def extra_repr(self) -> str:
        return f"p={self.p}"

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            ctx.save_for_backward(mask=None)
            return input_
        mask = torch.empty_like(input_).bernoulli_(1.0 - self.p)
        mask.div_(1.0 - self.p)
        if ctx.requires_grad:
            ctx.save_for_backward(mask=mask)
        return input_ * mask

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor) -> OpBackward:
        mask = ctx.saved["mask"]
        return OpBackward(grad_output if mask is None else grad_output * mask)
