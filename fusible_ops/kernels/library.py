"""The kernels as ``torch.library`` custom ops in the ``fusible_ops`` namespace.

Ops call the functions at the bottom of this file (:func:`fprop`, :func:`dgrad`,
:func:`wgrad`, :func:`bias_grad`, :func:`mlp_forward`, :func:`mlp_backward`). Under
``torch.compile``/``torch.export`` and whenever a dispatch mode is active (selective
activation checkpointing, fake tensors, ``make_fx``) they go through the custom ops,
so the tracer sees one opaque op per kernel with fake implementations for shapes; in
plain eager they call the backend directly (no dispatcher round trip, no host list
re-derived from the offsets). The ops are defined with ``torch.library.Library`` and
explicit schemas: a call costs about 4 us, against about 37 us for the same op made
with ``torch.library.custom_op`` (measured on the development machine, torch 2.13).

Each kernel that can write a caller buffer comes twice: a functional op that returns
its result (``grouped_fprop``, ``grouped_mlp_forward``, ...) and an ``_out`` op that
writes the buffer, declared a mutated argument, so that a compiled call writes into
the caller's memory (inductor then returns a view of it). The ``_out`` ops are used
only under ``torch.compile``/``torch.export`` and only when a buffer is given: a
dispatch mode such as selective activation checkpointing caches what an op returns,
not what it writes, so there the functional op runs and its result is copied into the
buffer by an ordinary ``copy_``. Split sizes reach the ops as int32 offsets on the
data's device, plus an optional CPU tensor of the sizes (``host_sizes``) when the
caller had them on the host; host lists are derived inside the ops only.
"""

from __future__ import annotations

import torch

from ..core.splits import SplitInfo as Splits
from .activation import ActivationSpec, row_dot
from .base import GroupedGemmBackend, group_ids_from_offsets
from .grouped_checks import host_split_sizes
from .inductor_lowering import LOWERING_ID, register_for_tracing

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
        return host_split_sizes(None, offsets)  # also refuses decreasing offsets
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


def _fprop(x, weight, bias, offsets, host_sizes, backend):
    return _backend(backend).fprop(x, weight, _host(offsets, host_sizes), offsets, bias=bias)


def _fprop_out(x, weight, bias, offsets, host_sizes, out, backend):
    _backend(backend).fprop(x, weight, _host(offsets, host_sizes), offsets, bias=bias, out=out)


def _fprop_fake(x, weight, bias, offsets, host_sizes, backend):
    return x.new_empty(x.shape[0], weight.shape[1])


def _dgrad(grad_out, weight, offsets, host_sizes, backend):
    return _backend(backend).dgrad(grad_out, weight, _host(offsets, host_sizes), offsets)


def _dgrad_out(grad_out, weight, offsets, host_sizes, out, backend):
    _backend(backend).dgrad(grad_out, weight, _host(offsets, host_sizes), offsets, out=out)


def _dgrad_fake(grad_out, weight, offsets, host_sizes, backend):
    return grad_out.new_empty(grad_out.shape[0], weight.shape[2])


def _wgrad(grad_out, x, offsets, host_sizes, backend):
    return _backend(backend).wgrad(grad_out, x, _host(offsets, host_sizes), offsets)


def _wgrad_fake(grad_out, x, offsets, host_sizes, backend):
    return x.new_empty(offsets.shape[0], grad_out.shape[1], x.shape[1])


def _bias_grad(grad_out, offsets, host_sizes, backend):
    groups = offsets.shape[0]
    return _backend(backend).bias_grad(grad_out, _host(offsets, host_sizes), offsets, groups)


def _bias_grad_fake(grad_out, offsets, host_sizes, backend):
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


def _mlp_forward(
    tensors: tuple, backend: str, flags: tuple, out: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``tensors``: ``(x, w1, b1, w2, b2, scales, offsets, host_sizes)``; ``flags``: the
    activation spec's fields and ``scale_after_fc2``."""
    x, w1, b1, w2, b2, scales, offsets, host_sizes = tensors
    *spec_args, scale_after_fc2 = flags
    host = _host(offsets, host_sizes)
    spec = _spec(*spec_args)
    return _mlp_forward_impl(
        _backend(backend), x, w1, b1, w2, b2, scales, host, offsets, spec, scale_after_fc2, out
    )


def _mlp_forward_op(*args, lowering: str = ""):
    return _mlp_forward(args[:8], args[8], args[9:])


def _mlp_forward_out_op(*args):
    """Like ``grouped_mlp_forward`` with ``out`` (after the tensors) written; returns ``pre``."""
    pre, _ = _mlp_forward(args[:8], args[9], args[10:], out=args[8])
    return pre


def _mlp_forward_fake(x, w1, b1, w2, b2, scales, offsets, host_sizes, *rest, lowering: str = ""):
    register_for_tracing()  # tracing: Inductor may lower the op
    return x.new_empty(x.shape[0], w1.shape[1]), x.new_empty(x.shape[0], w2.shape[1])


def _mlp_forward_out_fake(x, w1, b1, w2, b2, scales, offsets, host_sizes, *rest):
    return x.new_empty(x.shape[0], w1.shape[1])


def _k_major(weight: Tensor) -> bool:
    """A ``[G, N, K]`` view of an in_out (``[G, K, N]`` contiguous) weight."""
    return not weight.is_contiguous() and weight.transpose(-2, -1).is_contiguous()


def _wgrad_like(
    kernels: GroupedGemmBackend, weight: Tensor, grad_out: Tensor, x: Tensor, host, offsets
) -> Tensor:
    """The ``[G, N, K]`` gradient of ``weight``, laid out like it: for the view of an in_out
    weight, ``x^T @ grad_out`` per group (``[G, K, N]``) seen transposed, so the parameter
    receives its own layout without a copy."""
    if _k_major(weight):
        return kernels.wgrad(x, grad_out, host, offsets).transpose(-2, -1)
    return kernels.wgrad(grad_out, x, host, offsets)


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
    grad_w2 = _wgrad_like(kernels, w2, dy, act_scaled, host, offsets) if need_w2 else None
    del act_scaled
    grad_b2 = None
    if need_b2:
        dy_b2 = dy * scales.to(dy.dtype).unsqueeze(-1) if scale_after_fc2 else dy
        grad_b2 = kernels.bias_grad(dy_b2, host, offsets, groups)
    grad_input = kernels.dgrad(grad_pre, w1, host, offsets, out=grad_input_out) if need_input else None
    grad_w1 = _wgrad_like(kernels, w1, grad_pre, x, host, offsets) if need_w1 else None
    grad_b1 = kernels.bias_grad(grad_pre, host, offsets, groups) if need_b1 else None
    return grad_input, grad_w1, grad_b1, grad_w2, grad_b2, grad_scales


def _mlp_backward(dy, x, pre, w1, w2, b2, scales, offsets, host_sizes, grad_input, backend, rest):
    *spec_args, scale_after_fc2, needs = rest
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
        _spec(*spec_args),
        scale_after_fc2,
        tuple(needs),
        grad_input,
    )
    return tuple(dy.new_empty(0) if g is None else g for g in grads)


def _mlp_backward_op(dy, x, pre, w1, w2, b2, scales, offsets, host_sizes, backend, *rest, lowering=""):
    """``(grad_input, grad_w1, grad_b1, grad_w2, grad_b2, grad_scales)``, empty where not needed."""
    return _mlp_backward(dy, x, pre, w1, w2, b2, scales, offsets, host_sizes, None, backend, rest)


def _mlp_backward_out_op(dy, x, pre, w1, w2, b2, scales, offsets, host_sizes, grad_input, backend, *rest):
    """Writes ``grad_input``; returns the other five gradients (empty where not needed)."""
    return _mlp_backward(dy, x, pre, w1, w2, b2, scales, offsets, host_sizes, grad_input, backend, rest)[1:]


def _mlp_grad_fakes(dy, w1, w2, scales, needs) -> list[Tensor]:
    shapes = [
        (dy.shape[0], w1.shape[2]),
        tuple(w1.shape),
        (w1.shape[0], w1.shape[1]),
        tuple(w2.shape),
        (w2.shape[0], w2.shape[1]),
        tuple(scales.shape),
    ]
    like = [dy, dy, dy, dy, dy, scales]
    fakes = [t.new_empty(shape) if need else dy.new_empty(0) for t, shape, need in zip(like, shapes, needs)]
    for index, weight in ((1, w1), (3, w2)):  # weight gradients come laid out like the weights
        if needs[index] and _k_major(weight):
            fakes[index] = dy.new_empty(weight.shape[0], weight.shape[2], weight.shape[1]).transpose(-2, -1)
    return fakes


def _mlp_backward_fake(dy, x, pre, w1, w2, b2, scales, offsets, host_sizes, backend, *rest, lowering=""):
    register_for_tracing()
    return tuple(_mlp_grad_fakes(dy, w1, w2, scales, rest[-1]))


def _mlp_backward_out_fake(dy, x, pre, w1, w2, b2, scales, offsets, host_sizes, grad_input, backend, *rest):
    return tuple(_mlp_grad_fakes(dy, w1, w2, scales, rest[-1])[1:])


# ---------------------------------------------------------------- registration

_SPEC = "str kind, float limit, float alpha, float glu_linear_offset, int glu_interleave_size"
_FPROP = "Tensor x, Tensor weight, Tensor? bias, Tensor offsets, Tensor? host_sizes"
_DGRAD = "Tensor grad_out, Tensor weight, Tensor offsets, Tensor? host_sizes"
_MLP_FWD = "Tensor x, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, Tensor scales, Tensor offsets, Tensor? host_sizes"
_MLP_BWD = (
    "Tensor dy, Tensor? x, Tensor pre, Tensor w1, Tensor w2, Tensor? b2, Tensor scales, Tensor offsets, "
    "Tensor? host_sizes"
)
_MLP_FLAGS = f"{_SPEC}, bool scale_after_fc2"
#: the functional fused ops, which Inductor may lower, carry the lowering's fingerprint
_LOWERING_ARG = 'str lowering=""'
_FIVE = "(Tensor, Tensor, Tensor, Tensor, Tensor)"

#: name -> (schema, implementation, fake implementation)
_OPS = {
    "grouped_fprop": (f"({_FPROP}, str backend) -> Tensor", _fprop, _fprop_fake),
    "grouped_fprop_out": (f"({_FPROP}, Tensor(a!) out, str backend) -> ()", _fprop_out, lambda *a: None),
    "grouped_dgrad": (f"({_DGRAD}, str backend) -> Tensor", _dgrad, _dgrad_fake),
    "grouped_dgrad_out": (f"({_DGRAD}, Tensor(a!) out, str backend) -> ()", _dgrad_out, lambda *a: None),
    "grouped_wgrad": (
        "(Tensor grad_out, Tensor x, Tensor offsets, Tensor? host_sizes, str backend) -> Tensor",
        _wgrad,
        _wgrad_fake,
    ),
    "grouped_bias_grad": (
        "(Tensor grad_out, Tensor offsets, Tensor? host_sizes, str backend) -> Tensor",
        _bias_grad,
        _bias_grad_fake,
    ),
    "grouped_mlp_forward": (
        f"({_MLP_FWD}, str backend, {_MLP_FLAGS}, *, {_LOWERING_ARG}) -> (Tensor, Tensor)",
        _mlp_forward_op,
        _mlp_forward_fake,
    ),
    "grouped_mlp_forward_out": (
        f"({_MLP_FWD}, Tensor(a!) out, str backend, {_MLP_FLAGS}) -> Tensor",
        _mlp_forward_out_op,
        _mlp_forward_out_fake,
    ),
    "grouped_mlp_backward": (
        f"({_MLP_BWD}, str backend, {_MLP_FLAGS}, bool[] needs, *, {_LOWERING_ARG}) -> (Tensor, {_FIVE[1:]}",
        _mlp_backward_op,
        _mlp_backward_fake,
    ),
    "grouped_mlp_backward_out": (
        f"({_MLP_BWD}, Tensor(a!) grad_input, str backend, {_MLP_FLAGS}, bool[] needs) -> {_FIVE}",
        _mlp_backward_out_op,
        _mlp_backward_out_fake,
    ),
}

_LIBRARY = torch.library.Library("fusible_ops", "DEF")
for _name, (_schema, _impl, _fake) in _OPS.items():
    _LIBRARY.define(_name + _schema)
    # one implementation for every device: the backend named in the call decides how
    _LIBRARY.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"fusible_ops::{_name}", _fake, lib=_LIBRARY)


# ---------------------------------------------------------------- what ops call


def _write(out: Tensor | None, result: Tensor) -> Tensor:
    """``result`` in the caller's buffer when one is given (an ordinary ``copy_``)."""
    return result if out is None else out.copy_(result)


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
    args = (x, weight, bias, splits.offsets, splits.host_sizes)
    if out is not None and torch.compiler.is_compiling():
        torch.ops.fusible_ops.grouped_fprop_out(*args, out, kernels.name)
        return out
    return _write(out, torch.ops.fusible_ops.grouped_fprop(*args, kernels.name))


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
    args = (grad_out, weight, splits.offsets, splits.host_sizes)
    if out is not None and torch.compiler.is_compiling():
        torch.ops.fusible_ops.grouped_dgrad_out(*args, out, kernels.name)
        return out
    return _write(out, torch.ops.fusible_ops.grouped_dgrad(*args, kernels.name))


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
    args = (x, w1, b1, w2, b2, scales, splits.offsets, splits.host_sizes)
    flags = (*_spec_args(spec), scale_after_fc2)
    if out is not None and torch.compiler.is_compiling():
        pre = torch.ops.fusible_ops.grouped_mlp_forward_out(*args, out, kernels.name, *flags)
        return pre, out
    pre, y = torch.ops.fusible_ops.grouped_mlp_forward(*args, kernels.name, *flags, lowering=LOWERING_ID)
    return pre, _write(out, y)


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
    args = (dy, x, pre, w1, w2, b2, scales, splits.offsets, splits.host_sizes)
    flags = (*_spec_args(spec), scale_after_fc2, list(needs))
    if grad_input_out is not None and needs[0] and torch.compiler.is_compiling():
        grads = torch.ops.fusible_ops.grouped_mlp_backward_out(*args, grad_input_out, kernels.name, *flags)
        grads = (grad_input_out, *grads)
    else:
        grads = torch.ops.fusible_ops.grouped_mlp_backward(*args, kernels.name, *flags, lowering=LOWERING_ID)
        if needs[0]:
            grads = (_write(grad_input_out, grads[0]), *grads[1:])
    return tuple(g if need else None for g, need in zip(grads, needs))
