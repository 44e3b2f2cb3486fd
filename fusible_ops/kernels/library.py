"""The kernels as ``torch.library`` custom ops in the ``fusible_ops`` namespace.

Ops call the functions at the bottom of this file (:func:`fprop`, :func:`dgrad`,
:func:`wgrad`, :func:`bias_grad`, :func:`mlp_forward`, :func:`mlp_backward`). Under
``torch.compile``/``torch.export`` and whenever a dispatch mode is active (selective
activation checkpointing, fake tensors, ``make_fx``) they go through the custom ops,
so the tracer sees one opaque op per kernel with fake implementations for shapes; in
plain eager they call the backend directly, because a custom-op call with a mutated
argument costs about 100 us of Python dispatch on its own (docs/compile.md).

Caller buffers are mutated arguments (``out``, ``grad_input``): a compiled call
writes into the caller's memory. Split sizes reach the ops as int32 offsets on the
data's device, plus an optional CPU tensor of the sizes (``host_sizes``) when the
caller had them on the host; host lists are derived inside the ops only.
"""

from __future__ import annotations

import torch
from torch.library import custom_op

from ..splits import SplitInfo as Splits

from .activation import ActivationSpec, row_dot
from .base import GroupedGemmBackend, group_ids_from_offsets

Tensor = torch.Tensor


def use_library() -> bool:
    """Whether kernel calls must be visible to a tracer or dispatch mode."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def _backend(name: str) -> GroupedGemmBackend:
    from . import get_backend

    return get_backend(name)


def _host(offsets: Tensor, host_sizes: Tensor | None) -> list[int] | None:
    """Host split sizes inside an op: from ``host_sizes``, or from CPU offsets; None on device."""
    if host_sizes is not None:
        return [int(v) for v in host_sizes.tolist()]
    if offsets.device.type == "cpu":
        ends = offsets.tolist()
        return [e - s for s, e in zip([0, *ends[:-1]], ends)]
    return None


def _spec(kind: str, limit: float, alpha: float, glu_linear_offset: float, interleave: int) -> ActivationSpec:
    return ActivationSpec(
        kind,
        limit=limit,
        alpha=alpha,
        glu_linear_offset=glu_linear_offset,
        glu_interleave_size=interleave or None,
    )


def _spec_args(spec: ActivationSpec) -> tuple:
    return (
        spec.kind,
        float(spec.limit),
        float(spec.alpha),
        float(spec.glu_linear_offset),
        spec.glu_interleave_size or 0,
    )


# ---------------------------------------------------------------- grouped GEMMs


@custom_op("fusible_ops::grouped_fprop", mutates_args=("out",))
def _grouped_fprop_op(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    offsets: Tensor,
    host_sizes: Tensor | None,
    out: Tensor,
    backend: str,
) -> None:
    _backend(backend).fprop(x, weight, _host(offsets, host_sizes), offsets, bias=bias, out=out)


@_grouped_fprop_op.register_fake
def _(x, weight, bias, offsets, host_sizes, out, backend):
    return None


@custom_op("fusible_ops::grouped_dgrad", mutates_args=("out",))
def _grouped_dgrad_op(
    grad_out: Tensor, weight: Tensor, offsets: Tensor, host_sizes: Tensor | None, out: Tensor, backend: str
) -> None:
    _backend(backend).dgrad(grad_out, weight, _host(offsets, host_sizes), offsets, out=out)


@_grouped_dgrad_op.register_fake
def _(grad_out, weight, offsets, host_sizes, out, backend):
    return None


@custom_op("fusible_ops::grouped_wgrad", mutates_args=())
def _grouped_wgrad_op(
    grad_out: Tensor, x: Tensor, offsets: Tensor, host_sizes: Tensor | None, backend: str
) -> Tensor:
    return _backend(backend).wgrad(grad_out, x, _host(offsets, host_sizes), offsets).clone()


@_grouped_wgrad_op.register_fake
def _(grad_out, x, offsets, host_sizes, backend):
    return x.new_empty(offsets.shape[0], grad_out.shape[1], x.shape[1])


@custom_op("fusible_ops::grouped_bias_grad", mutates_args=())
def _grouped_bias_grad_op(
    grad_out: Tensor, offsets: Tensor, host_sizes: Tensor | None, backend: str
) -> Tensor:
    groups = offsets.shape[0]
    return _backend(backend).bias_grad(grad_out, _host(offsets, host_sizes), offsets, groups)


@_grouped_bias_grad_op.register_fake
def _(grad_out, offsets, host_sizes, backend):
    return grad_out.new_empty(offsets.shape[0], grad_out.shape[1])


# ---------------------------------------------------------------- fused grouped MLP


def _mlp_forward_impl(
    kernels: GroupedGemmBackend,
    x: Tensor,
    w1: Tensor,
    b1: Tensor | None,
    w2: Tensor,
    b2: Tensor | None,
    scales: Tensor,
    host: list[int] | None,
    offsets: Tensor,
    spec: ActivationSpec,
    scale_after_fc2: bool,
    out: Tensor | None,
) -> tuple[Tensor, Tensor]:
    pre, act = kernels.fc1_fprop_act(x, w1, b1, host, offsets, spec, None if scale_after_fc2 else scales)
    y = kernels.fprop(act, w2, host, offsets, bias=b2, out=out)
    if scale_after_fc2:
        y.mul_(scales.to(y.dtype).unsqueeze(-1))
    return pre, y


@custom_op("fusible_ops::grouped_mlp_forward", mutates_args=("out",))
def _grouped_mlp_forward_op(
    x: Tensor,
    w1: Tensor,
    b1: Tensor | None,
    w2: Tensor,
    b2: Tensor | None,
    scales: Tensor,
    offsets: Tensor,
    host_sizes: Tensor | None,
    out: Tensor,
    backend: str,
    kind: str,
    limit: float,
    alpha: float,
    glu_linear_offset: float,
    glu_interleave_size: int,
    scale_after_fc2: bool,
) -> Tensor:
    spec = _spec(kind, limit, alpha, glu_linear_offset, glu_interleave_size)
    host = _host(offsets, host_sizes)
    pre, _ = _mlp_forward_impl(
        _backend(backend), x, w1, b1, w2, b2, scales, host, offsets, spec, scale_after_fc2, out
    )
    return pre


@_grouped_mlp_forward_op.register_fake
def _(x, w1, b1, w2, b2, scales, offsets, host_sizes, out, backend, kind, *spec_and_flags):
    return x.new_empty(x.shape[0], w1.shape[1])


def _mlp_backward_impl(
    kernels: GroupedGemmBackend,
    dy: Tensor,
    x: Tensor | None,
    pre: Tensor,
    w1: Tensor,
    w2: Tensor,
    b2: Tensor | None,
    scales: Tensor,
    host: list[int] | None,
    offsets: Tensor,
    spec: ActivationSpec,
    scale_after_fc2: bool,
    needs: tuple[bool, bool, bool, bool, bool, bool],
    grad_input_out: Tensor | None,
) -> tuple[Tensor | None, ...]:
    """``(grad_input, grad_w1, grad_b1, grad_w2, grad_b2, grad_scales)``; None where not needed.

    ``needs``: input, w1, b1, w2, b2, scales. Both patterns share one backward: with
    ``y = s * (act @ W2^T + b2)`` the gradients w.r.t. act and W2 equal those of
    ``y = (s * act) @ W2^T + b2``; only the scales' gradient gains the bias term and
    fc2's bias gradient is scaled.
    """
    need_input, need_w1, need_b1, need_w2, need_b2, need_scales = needs
    groups = w1.shape[0]
    grad_pre, grad_scales, act_scaled = kernels.fc2_dgrad_act(dy, w2, pre, host, offsets, spec, scales)
    if not need_scales:
        grad_scales = None
    elif scale_after_fc2 and b2 is not None:
        group_bias = b2.index_select(0, group_ids_from_offsets(offsets, dy.shape[0]))
        grad_scales = grad_scales + row_dot(dy, group_bias, grad_scales.dtype)
    grad_w2 = kernels.wgrad(dy, act_scaled, host, offsets) if need_w2 else None
    del act_scaled
    grad_b2 = None
    if need_b2:
        dy_b2 = dy * scales.to(dy.dtype).unsqueeze(-1) if scale_after_fc2 else dy
        grad_b2 = kernels.bias_grad(dy_b2, host, offsets, groups)
    grad_input = kernels.dgrad(grad_pre, w1, host, offsets, out=grad_input_out) if need_input else None
    grad_w1 = kernels.wgrad(grad_pre, x, host, offsets) if need_w1 else None
    grad_b1 = kernels.bias_grad(grad_pre, host, offsets, groups) if need_b1 else None
    return grad_input, grad_w1, grad_b1, grad_w2, grad_b2, grad_scales


@custom_op("fusible_ops::grouped_mlp_backward", mutates_args=("grad_input",))
def _grouped_mlp_backward_op(
    dy: Tensor,
    x: Tensor | None,
    pre: Tensor,
    w1: Tensor,
    w2: Tensor,
    b2: Tensor | None,
    scales: Tensor,
    offsets: Tensor,
    host_sizes: Tensor | None,
    grad_input: Tensor | None,
    backend: str,
    kind: str,
    limit: float,
    alpha: float,
    glu_linear_offset: float,
    glu_interleave_size: int,
    scale_after_fc2: bool,
    needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Returns ``(grad_w1, grad_b1, grad_w2, grad_b2, grad_scales)``; empty tensors where not needed."""
    spec = _spec(kind, limit, alpha, glu_linear_offset, glu_interleave_size)
    grads = _mlp_backward_impl(
        _backend(backend),
        dy,
        x,
        pre,
        w1,
        w2,
        b2,
        scales,
        _host(offsets, host_sizes),
        offsets,
        spec,
        scale_after_fc2,
        tuple(needs),
        grad_input,
    )
    # outputs of a custom op must not alias inputs or each other: fresh copies of pooled storages
    return tuple(dy.new_empty(0) if g is None else g.clone() for g in grads[1:])


@_grouped_mlp_backward_op.register_fake
def _(dy, x, pre, w1, w2, b2, scales, offsets, host_sizes, grad_input, backend, *rest):
    needs = rest[-1]
    shapes = [w1.shape, (w1.shape[0], w1.shape[1]), w2.shape, (w2.shape[0], w2.shape[1]), scales.shape]
    return tuple(
        (dy.new_empty(tuple(shape)) if i < 4 else scales.new_empty(tuple(shape))) if need else dy.new_empty(0)
        for i, (shape, need) in enumerate(zip(shapes, needs[1:]))
    )


# ---------------------------------------------------------------- what ops call


def fprop(
    kernels: GroupedGemmBackend,
    x: Tensor,
    weight: Tensor,
    splits: Splits,
    *,
    bias: Tensor | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """``[M, K] -> [M, N]`` grouped forward GEMM (writes ``out`` when given)."""
    if not use_library():
        return kernels.fprop(x, weight, splits.host, splits.offsets, bias=bias, out=out)
    if out is None:
        out = x.new_empty(x.shape[0], weight.shape[1])
    torch.ops.fusible_ops.grouped_fprop(x, weight, bias, splits.offsets, splits.host_sizes, out, kernels.name)
    return out


def dgrad(
    kernels: GroupedGemmBackend,
    grad_out: Tensor,
    weight: Tensor,
    splits: Splits,
    *,
    out: Tensor | None = None,
) -> Tensor:
    """``[M, N] -> [M, K]`` grouped input-gradient GEMM (writes ``out`` when given)."""
    if not use_library():
        return kernels.dgrad(grad_out, weight, splits.host, splits.offsets, out=out)
    if out is None:
        out = grad_out.new_empty(grad_out.shape[0], weight.shape[2])
    torch.ops.fusible_ops.grouped_dgrad(
        grad_out, weight, splits.offsets, splits.host_sizes, out, kernels.name
    )
    return out


def wgrad(kernels: GroupedGemmBackend, grad_out: Tensor, x: Tensor, splits: Splits) -> Tensor:
    """``[G, N, K]`` grouped weight gradient."""
    if not use_library():
        return kernels.wgrad(grad_out, x, splits.host, splits.offsets)
    return torch.ops.fusible_ops.grouped_wgrad(grad_out, x, splits.offsets, splits.host_sizes, kernels.name)


def bias_grad(kernels: GroupedGemmBackend, grad_out: Tensor, splits: Splits, num_groups: int) -> Tensor:
    """``[G, N]`` per-group column sums of ``grad_out``."""
    if not use_library():
        return kernels.bias_grad(grad_out, splits.host, splits.offsets, num_groups)
    return torch.ops.fusible_ops.grouped_bias_grad(grad_out, splits.offsets, splits.host_sizes, kernels.name)


def mlp_forward(
    kernels: GroupedGemmBackend,
    x: Tensor,
    w1: Tensor,
    b1: Tensor | None,
    w2: Tensor,
    b2: Tensor | None,
    scales: Tensor,
    splits: Splits,
    spec: ActivationSpec,
    *,
    scale_after_fc2: bool,
    out: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """fc1 -> (scaled) activation -> fc2 (-> scale): returns ``(pre, y)``; ``y`` is ``out`` when given."""
    if not use_library():
        return _mlp_forward_impl(
            kernels, x, w1, b1, w2, b2, scales, splits.host, splits.offsets, spec, scale_after_fc2, out
        )
    if out is None:
        out = x.new_empty(x.shape[0], w2.shape[1])
    pre = torch.ops.fusible_ops.grouped_mlp_forward(
        x,
        w1,
        b1,
        w2,
        b2,
        scales,
        splits.offsets,
        splits.host_sizes,
        out,
        kernels.name,
        *_spec_args(spec),
        scale_after_fc2,
    )
    return pre, out


def mlp_backward(
    kernels: GroupedGemmBackend,
    dy: Tensor,
    x: Tensor | None,
    pre: Tensor,
    w1: Tensor,
    w2: Tensor,
    b2: Tensor | None,
    scales: Tensor,
    splits: Splits,
    spec: ActivationSpec,
    *,
    scale_after_fc2: bool,
    needs: tuple[bool, bool, bool, bool, bool, bool],
    grad_input_out: Tensor | None,
) -> tuple[Tensor | None, ...]:
    """``(grad_input, grad_w1, grad_b1, grad_w2, grad_b2, grad_scales)``, None where not needed."""
    if not use_library():
        return _mlp_backward_impl(
            kernels,
            dy,
            x,
            pre,
            w1,
            w2,
            b2,
            scales,
            splits.host,
            splits.offsets,
            spec,
            scale_after_fc2,
            needs,
            grad_input_out,
        )
    grad_input = None
    if needs[0]:
        grad_input = grad_input_out if grad_input_out is not None else dy.new_empty(dy.shape[0], w1.shape[2])
    grads = torch.ops.fusible_ops.grouped_mlp_backward(
        dy,
        x,
        pre,
        w1,
        w2,
        b2,
        scales,
        splits.offsets,
        splits.host_sizes,
        grad_input,
        kernels.name,
        *_spec_args(spec),
        scale_after_fc2,
        list(needs),
    )
    return (grad_input, *(g if need else None for g, need in zip(grads, needs[1:])))
