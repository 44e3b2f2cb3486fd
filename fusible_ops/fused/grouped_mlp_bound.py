"""GroupedMLP bound to one call signature (what the fuser's fast path runs).

:func:`bind_grouped_mlp` answers a :class:`~fusible_ops.fuser.fast_path.FastCall`'s
request for an unquantized :class:`~fusible_ops.fused.grouped_mlp.GroupedMLP` whose
signature needs no casts (the parameters are in the compute dtype) and whose backend is
one of the library's. :class:`BoundGroupedMLP` computes and saves what ``fuser_forward``
and ``fuser_backward`` do for that signature, with the per-call decisions that follow
from metadata made once.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.dtypes import compute_dtype_of
from ..core.shapes import as_flat
from ..core.splits import host_split_info, to_split_info

Tensor = torch.Tensor


class BoundGroupedMLP:
    """One signature's GroupedMLP call: ``forward`` and ``backward`` on flat arguments.

    ``extra_inputs`` are the call's, flat, in op order; ``params`` the parameters that are
    not None, flat, in op order (fc1's weight and bias, fc2's weight and bias).
    """

    __slots__ = (
        "kernels", "scales_at", "w1_at", "b1_at", "w2_at", "b2_at", "in_features", "out_features",
        "in_out", "needs", "save_x", "input_2d", "scales_1d", "num_extra", "host_splits", "plain",
    )  # fmt: skip

    def __init__(self, op: Any, positions: tuple, needs: tuple, input_: Tensor, extra_inputs: tuple,
                 params: tuple) -> None:  # fmt: skip
        """``input_``, ``extra_inputs`` and ``params``: the first call's (the signature's metadata)."""
        self.num_extra = len(extra_inputs)
        self.scales_at, self.w1_at, self.b1_at, self.w2_at, self.b2_at = positions
        self.in_features, self.out_features = op.fc1.in_features, op.fc2.out_features
        self.in_out = (op.fc1.weight_layout == "in_out", op.fc2.weight_layout == "in_out")
        self.needs = needs
        self.save_x = needs[1]
        self.input_2d = input_.dim() == 2
        self.scales_1d = extra_inputs[self.scales_at].dim() == 1
        split_sizes = extra_inputs[0]
        #: split sizes in a CPU tensor (the signature fixes the device): read on the host
        self.host_splits = type(split_sizes) is torch.Tensor and split_sizes.is_cpu
        #: the parameters are exactly (fc1.weight, fc2.weight), both out_in
        self.plain = positions[1:] == (0, None, 1, None) and not any(self.in_out)
        x = input_ if self.input_2d else input_.reshape(-1, self.in_features)
        operands = (x, *self._weights(params))
        self.kernels = op.choice.backend.bind_mlp(op.spec, op.scale_after_fc2, operands)

    def _weights(self, params: tuple) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
        if self.plain:
            w1, w2 = params
            return w1, None, w2, None
        w1, w2 = params[self.w1_at], params[self.w2_at]
        if self.in_out[0]:
            w1 = w1.transpose(-2, -1)
        if self.in_out[1]:
            w2 = w2.transpose(-2, -1)
        b1 = None if self.b1_at is None else params[self.b1_at]
        b2 = None if self.b2_at is None else params[self.b2_at]
        return w1, b1, w2, b2

    def forward(self, input_: Tensor, extra_inputs: tuple, params: tuple, save: bool):
        """``(output, tensors to save, facts for backward)`` (nothing saved unless ``save``)."""
        x = input_ if self.input_2d else input_.reshape(-1, self.in_features)
        w1, b1, w2, b2 = self._weights(params)
        split_sizes = extra_inputs[0]
        splits = host_split_info(split_sizes, x) if self.host_splits else to_split_info(split_sizes, x.shape[0], x)
        scales_in = extra_inputs[self.scales_at]
        scales = scales_in if self.scales_1d else as_flat(scales_in)
        pre, y = self.kernels.forward(x, w1, b1, w2, b2, scales, splits.host, splits.offsets)
        if not self.input_2d:
            y = y.view(*input_.shape[:-1], self.out_features)
        if not save:
            return y, (), None
        saved = (x if self.save_x else None, pre, scales, splits.offsets, splits.host_sizes)
        return y, saved, (splits.host, input_.shape, scales_in.shape)

    def backward(self, saved: tuple, facts: tuple, params: tuple, grad_output: Tensor):
        """``(grad input, grads of the flat extra inputs, grads of the flat params)``."""
        x, pre, scales, offsets, _ = saved
        host, input_shape, scales_shape = facts
        w1, _, w2, b2 = self._weights(params)
        dy = grad_output if self.input_2d else grad_output.reshape(-1, self.out_features)
        if not dy.is_contiguous():
            dy = dy.contiguous()
        grads = self.kernels.backward(dy, x, pre, w1, w2, b2, scales, host, offsets, self.needs)
        grad_input, grad_w1, grad_b1, grad_w2, grad_b2, grad_scales = grads
        if grad_input is not None and not self.input_2d:
            grad_input = grad_input.view(input_shape)
        if grad_scales is not None and grad_scales.shape != scales_shape:
            grad_scales = grad_scales.view(scales_shape)
        grad_extra: list[Tensor | None] = [None] * self.num_extra
        grad_extra[self.scales_at] = grad_scales
        if self.plain:
            return grad_input, grad_extra, (grad_w1, grad_w2)
        grad_params: list[Tensor | None] = [None] * len(params)
        grad_params[self.w1_at] = grad_w1.transpose(-2, -1) if self.in_out[0] and grad_w1 is not None else grad_w1
        grad_params[self.w2_at] = grad_w2.transpose(-2, -1) if self.in_out[1] and grad_w2 is not None else grad_w2
        if self.b1_at is not None:
            grad_params[self.b1_at] = grad_b1
        if self.b2_at is not None:
            grad_params[self.b2_at] = grad_b2
        return grad_input, grad_extra, grad_params


def bind_grouped_mlp(
    op: Any,
    input_: Tensor,
    extra_inputs: tuple,
    param_dicts: list[dict[str, Tensor | None]],
    grad_flags: list[tuple[bool, bool, bool]] | None,
) -> BoundGroupedMLP | None:
    """The bound call of ``op`` (a GroupedMLP) for this signature, or None when the
    signature needs what only ``fuser_forward`` does (casts, quantization, separate gate
    and up weights, a backend whose hook results are checked on every call)."""
    choice = op.choice
    if op.gate_up or op.quantized is not None or not op.scaled or choice is None:
        return None
    backend = choice.backend
    if backend.check_hook_results:
        return None
    dtype = compute_dtype_of(input_)
    p1, p2 = param_dicts[0], param_dicts[2]
    params = [t for d in param_dicts for t in d.values() if t is not None]
    if input_.dtype != dtype or any(t.dtype != dtype for t in params):
        return None
    flat_positions = {}
    position = 0
    for op_index, d in enumerate(param_dicts):
        for name, tensor in d.items():
            if tensor is not None:
                flat_positions[(op_index, name)] = position
                position += 1
    scales_at = 2 if op.scale_after_fc2 else 1  # fc1's split sizes, then the scales
    positions = (
        scales_at,
        flat_positions[(0, "weight")],
        flat_positions.get((0, "bias")),
        flat_positions[(2, "weight")],
        flat_positions.get((2, "bias")),
    )
    if grad_flags is None:  # nothing needs a gradient
        grad_flags = [(False, False, False)] * len(param_dicts)
    grad_1, input_grad, _ = grad_flags[0]
    grad_2 = grad_flags[2][0]
    scales = extra_inputs[scales_at]

    def wants(flag: bool, tensor: Tensor | None) -> bool:
        return bool(flag and tensor is not None and tensor.requires_grad)

    needs = (
        bool(grad_1 and input_grad),
        wants(grad_1, p1["weight"]),
        wants(grad_1, p1["bias"]),
        wants(grad_2, p2["weight"]),
        wants(grad_2, p2["bias"]),
        bool(scales.requires_grad),
    )
    return BoundGroupedMLP(op, positions, needs, input_, extra_inputs, tuple(params))
