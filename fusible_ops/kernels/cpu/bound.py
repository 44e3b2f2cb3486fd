"""The CPU backend's fused grouped MLP bound to one call signature.

At small problems every GEMM of the block is one ``torch._grouped_mm`` over all groups
and the SwiGLU pass is one block (see :mod:`.backend`). Which of those decisions hold
follows from the signature's metadata (shapes, strides, dtype) and from split sizes
that cover every row, which the ops check on every call. :class:`CpuBoundMLP` makes
them once; a call then runs the same torch ops as the backend's hooks, in the same
order, without asking again. Anything else (biases, in_out weights, large or
unaligned problems, the backend's tuning attributes changed since) runs the hooks.
"""

from __future__ import annotations

import torch

from ..bound_mlp import BoundMLP, like_scales
from .backend import (
    _backward_block,
    _column_major,
    _grouped_mm_takes,
    _relayout_for_dgrad,
    _swiglu,
)

Tensor = torch.Tensor


class CpuBoundMLP(BoundMLP):
    """:class:`~fusible_ops.kernels.bound_mlp.BoundMLP` with the one-``_grouped_mm`` path decided once."""

    __slots__ = ("whole", "tuning", "pooled", "relayout")

    def __init__(self, backend, spec, scale_after_fc2, operands) -> None:  # noqa: ANN001
        super().__init__(backend, spec, scale_after_fc2, operands)
        x, w1, b1, w2, b2 = operands
        self.tuning = self._tuning()
        rows, dtype = x.shape[0], x.dtype
        groups, n_pre, k_in = w1.shape
        _, h_out, n_act = w2.shape
        # the operands each hook would test: x as given; act, dy (made contiguous),
        # grad_pre and pre fresh and contiguous
        contiguous = {width: (width, 1) for width in (n_pre, n_act, h_out)}
        self.whole = bool(
            self.hooks.fuses
            and b1 is None
            and b2 is None
            and w1.is_contiguous()
            and w2.is_contiguous()
            and backend._is_fast_swiglu(spec)
            and rows <= backend._block_rows(x.new_empty(0, n_pre))
            and backend._is_small(groups, rows, n_pre, k_in)
            and backend._is_small(groups, rows, h_out, n_act)
            and _grouped_mm_takes(dtype, tuple(x.stride()), n_pre, k_in)
            and _grouped_mm_takes(dtype, contiguous[n_pre], n_pre, k_in)
            and _grouped_mm_takes(dtype, contiguous[n_act], h_out, n_act)
            and _grouped_mm_takes(dtype, contiguous[h_out], h_out, n_act)
        )
        # what backend._empty and _dgrad_operand decide from metadata
        self.pooled = backend.reuse_buffers and rows * n_pre * x.element_size() >= backend.buffers.min_bytes
        self.relayout = (_relayout_for_dgrad(w1), _relayout_for_dgrad(w2))

    def _tuning(self) -> tuple:
        backend = self.backend
        return (
            backend.row_block, backend.block_bytes, backend.small_problem_macs, backend.reuse_buffers,
            backend.buffers.min_bytes,
        )  # fmt: skip

    def forward(self, x, w1, b1, w2, b2, scales, host, offsets):  # noqa: ANN001, ANN201
        if not self.whole or self._tuning() != self.tuning:
            return super().forward(x, w1, b1, w2, b2, scales, host, offsets)
        pre = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets)
        act = _swiglu(pre)
        if not self.scale_after_fc2:
            act.mul_(scales.to(act.dtype).unsqueeze(-1))
        y = torch._grouped_mm(act, w2.transpose(-2, -1), offs=offsets)
        if self.scale_after_fc2:
            y.mul_(scales.to(y.dtype).unsqueeze(-1))
        return pre, y

    def backward(self, dy, x, pre, w1, w2, b2, scales, host, offsets, needs):  # noqa: ANN001, ANN201
        if not self.whole or self._tuning() != self.tuning:
            return super().backward(dy, x, pre, w1, w2, b2, scales, host, offsets, needs)
        need_input, need_w1, _, need_w2, _, need_scales = needs
        if self.pooled:
            grad_pre = self.backend.buffers.empty(tuple(pre.shape), pre.dtype, pre.device)
        else:
            grad_pre = pre.new_empty(pre.shape)
        grad_scales = scales.new_empty(dy.shape[0])
        relayout_w1, relayout_w2 = self.relayout
        if relayout_w2:  # see backend._dgrad_operand
            w2 = _column_major(w2)
        act = torch._grouped_mm(dy, w2, offs=offsets)
        _backward_block(self.spec, True, pre, scales, act, grad_pre, grad_scales, act)
        grad_w2 = torch._grouped_mm(dy.t(), act, offs=offsets) if need_w2 else None
        del act
        grad_input = None
        if need_input:
            if relayout_w1:
                w1 = _column_major(w1)
            grad_input = torch._grouped_mm(grad_pre, w1, offs=offsets)
        grad_w1 = torch._grouped_mm(grad_pre.t(), x, offs=offsets) if need_w1 else None
        grad_scales = like_scales(grad_scales, scales) if need_scales else None
        return grad_input, grad_w1, None, grad_w2, None, grad_scales
