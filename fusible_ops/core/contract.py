"""Checks that an op's forward and backward return what the fuser expects.

A custom fused op that returns the wrong structure would otherwise fail deep inside
the fuser or autograd with an unpacking error, or, worse, hand a gradient to the wrong
parameter. These checks name the op, the method and the expected structure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def _op_label(op: object) -> str:
    return type(op).__name__


def _shape(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)}"
    return type(value).__name__


def check_forward_result(op: object, result: Any, extra_output_counts: Sequence[int]) -> None:
    """``result`` is ``(output, [extra outputs of each basic op])``."""
    # the common case in one pass; the messages are built only for a result that fails
    if isinstance(result, (tuple, list)) and len(result) == 2:
        output, per_op = result
        if (
            isinstance(output, torch.Tensor)
            and isinstance(per_op, (tuple, list))
            and len(per_op) == len(extra_output_counts)
            and all(
                isinstance(outs, (tuple, list)) and len(outs) == wanted
                for outs, wanted in zip(per_op, extra_output_counts)
            )
        ):
            return
    _explain_forward_result(op, result, extra_output_counts)


def _explain_forward_result(op: object, result: Any, extra_output_counts: Sequence[int]) -> None:
    where = f"{_op_label(op)}.fuser_forward"
    count = len(extra_output_counts)
    expected = f"(output tensor, a list of {count} tuples: each basic op's extra outputs)"
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise TypeError(f"{where} returned {_shape(result)}; expected {expected}")
    output, per_op = result
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"{where} returned {_shape(output)} as its output; expected {expected}")
    if not isinstance(per_op, (tuple, list)) or len(per_op) != count:
        raise TypeError(f"{where} returned {_shape(per_op)} as extra outputs; expected {expected}")
    for index, (outs, wanted) in enumerate(zip(per_op, extra_output_counts)):
        if not isinstance(outs, (tuple, list)) or len(outs) != wanted:
            raise TypeError(
                f"{where}: the extra outputs of basic op {index} are {_shape(outs)}; expected a tuple "
                f"of {wanted} tensor(s) (expected structure: {expected})"
            )


def check_backward_result(
    op: object,
    result: Any,
    input_shape: tuple[int, ...] | None,
    params: Sequence[Sequence[torch.Tensor]],
    extra_counts: Sequence[int],
) -> None:
    """``result`` is ``(grad_input, [param grads per basic op], [extra-input grads per basic op])``.

    ``params``: per basic op, the parameter tensors of the call (None ones dropped), in
    the order their gradients come; ``input_shape``: the shape of the entry's main input
    (None: not checked, while tracing).
    """
    count = len(params)
    # the messages are built only when a check fails: this runs on every backward
    if not isinstance(result, (tuple, list)) or len(result) != 3:
        raise TypeError(
            f"{_backward_where(op)} returned {_shape(result)}; expected {_backward_expected(count)}"
        )
    grad_input, grad_params, grad_extra = result
    if grad_input is not None:
        if not isinstance(grad_input, torch.Tensor):
            raise TypeError(
                f"{_backward_where(op)} returned {_shape(grad_input)} as grad_input; expected a tensor or None"
            )
        if input_shape is not None and tuple(grad_input.shape) != tuple(input_shape):
            raise RuntimeError(
                f"{_backward_where(op)} returned a grad_input of shape {list(grad_input.shape)}; the input had shape "
                f"{list(input_shape)}"
            )
    for name, per_op in (("parameter gradients", grad_params), ("extra-input gradients", grad_extra)):
        if not isinstance(per_op, (tuple, list)) or len(per_op) != count:
            raise TypeError(
                f"{_backward_where(op)} returned {_shape(per_op)} as {name}; expected {_backward_expected(count)}"
            )
    for index, (grads, op_params) in enumerate(zip(grad_params, params)):
        _check_param_grads(op, count, index, grads, op_params)
    for index, (grads, wanted) in enumerate(zip(grad_extra, extra_counts)):
        if grads is None or (isinstance(grads, (tuple, list)) and len(grads) in (0, wanted)):
            continue
        raise TypeError(
            f"{_backward_where(op)}: the extra-input gradients of basic op {index} are {_shape(grads)}; expected a "
            f"tuple of {wanted} (tensor or None) (expected structure: {_backward_expected(count)})"
        )


def _backward_where(op: object) -> str:
    return f"{_op_label(op)}.fuser_backward"


def _backward_expected(count: int) -> str:
    return (
        f"(grad_input, a list of {count} lists of parameter gradients, a list of {count} tuples of "
        "extra-input gradients), one entry per basic op"
    )


def _check_param_grads(
    op: object, count: int, index: int, grads: Any, op_params: Sequence[torch.Tensor]
) -> None:
    if grads is None or (isinstance(grads, (tuple, list)) and not grads):
        return  # no parameter gradients for this op
    if not isinstance(grads, (tuple, list)) or len(grads) != len(op_params):
        raise TypeError(
            f"{_backward_where(op)}: the parameter gradients of basic op {index} are {_shape(grads)}; expected a list "
            f"of {len(op_params)} (tensor or None), one per parameter (expected structure: {_backward_expected(count)})"
        )
    for k, (grad, param) in enumerate(zip(grads, op_params)):
        if grad is None:
            continue
        if not isinstance(grad, torch.Tensor):
            raise TypeError(
                f"{_backward_where(op)}: gradient {k} of basic op {index} is {_shape(grad)}; expected a tensor or None"
            )
        if not torch.compiler.is_compiling() and grad.shape != param.shape:
            raise RuntimeError(
                f"{_backward_where(op)}: gradient {k} of basic op {index} has shape {list(grad.shape)}; the parameter "
                f"has shape {list(param.shape)}"
            )
