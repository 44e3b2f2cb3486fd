"""What BasicLinear computes under a low-precision recipe with a DTensor (tensor-parallel)
weight on a one-dimensional mesh.

Each rank runs the quantized GEMMs of :mod:`fusible_ops.basic.quantized_linear` on its
shards, quantizing them where they are (as Transformer Engine and Megatron-Core do):

- colwise (weight ``Shard(0)``): the input is made ``Replicate``; ``y`` is ``Shard(-1)``;
  the input gradient is ``Partial`` (summed over the ranks), the weight's ``Shard(0)``;
- rowwise (weight ``Shard(1)``): the input is made ``Shard(-1)``; ``y`` is ``Partial``;
  the input gradient is ``Shard(-1)``, the weight's ``Shard(1)``.

Tiles therefore never cross a shard boundary: with MXFP8 and shards of a multiple of 32
features this is the unsharded result; for recipes whose tiles span a whole row or
tensor (rowwise, tensorwise, blockwise) the scales of a sharded dimension are per shard.
The weight shards are quantized afresh on every call (no cached copy).
"""

from __future__ import annotations

import torch

from ..core.dtypes import cast
from ..core.op import OpBackward, OperationContext
from ..kernels.quantized import QuantizedChoice
from . import quantized_linear

Tensor = torch.Tensor


def _placements(op_name: str, weight) -> tuple:
    """``(input, output, grad_input)`` placements for ``weight``'s sharding, or an error."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    sharded_dim = None
    if weight.device_mesh.ndim == 1 and len(weight.placements) == 1 and weight.placements[0].is_shard():
        sharded_dim = weight.placements[0].dim % 2
    if sharded_dim == 0:  # colwise
        return (Replicate(),), (Shard(-1),), (Partial(),)
    if sharded_dim == 1:  # rowwise
        return (Shard(-1),), (Partial(),), (Shard(-1),)
    raise ValueError(
        f"{op_name}: a low-precision recipe with a DTensor weight needs it sharded colwise (Shard(0)) or "
        f"rowwise (Shard(1)) on a one-dimensional mesh, got {weight.placements} on a "
        f"{weight.device_mesh.ndim}-D mesh"
    )


def _fix_dim(placements: tuple, ndim: int) -> list:
    from torch.distributed.tensor import Shard

    return [Shard(p.dim % ndim) if p.is_shard() else p for p in placements]


def forward(ctx: OperationContext, linear, choice: QuantizedChoice, x, weight, bias: Tensor | None) -> Tensor:
    """``x`` ``[..., K]`` (a DTensor), ``weight`` a DTensor ``[N, K]`` -> a DTensor ``[..., N]``."""
    from torch.distributed.tensor import DTensor

    name = linear.op_name()
    if not isinstance(x, DTensor):
        raise TypeError(f"{name}: with a DTensor weight under a recipe, the input must be a DTensor too")
    if bias is not None:
        raise ValueError(f"{name}: a folded bias is not supported with a DTensor weight under a recipe")
    x_place, y_place, dx_place = _placements(name, weight)
    mesh = weight.device_mesh
    x_local = x.redistribute(mesh, _fix_dim(x_place, x.ndim)).to_local()
    w_local = weight.to_local()
    dtype = x_local.dtype
    y_local = quantized_linear.linear_forward(ctx, linear, choice, x_local, cast(w_local, dtype), None)
    if ctx.requires_grad:
        ctx.tp_layout = (mesh, x.shape, _fix_dim(dx_place, x.ndim), weight.placements)
    out_shape = (*x.shape[:-1], linear.out_features)
    return DTensor.from_local(y_local, mesh, _fix_dim(y_place, x.ndim), shape=out_shape,
                              stride=_contiguous_stride(out_shape))  # fmt: skip


def backward(linear, ctx: OperationContext, grad_output) -> OpBackward:
    """Gradients of :func:`forward`: DTensors placed as the module docstring says."""
    from torch.distributed.tensor import DTensor

    mesh, x_shape, dx_place, w_place = ctx.tp_layout
    weight = ctx.params["weight"]
    _, y_place, _ = _placements(linear.op_name(), weight)
    dy = grad_output.redistribute(mesh, _fix_dim(_grad_layout(y_place), grad_output.ndim)).to_local()
    local = quantized_linear.linear_backward(linear, ctx, dy, weight_param=weight.to_local())
    grad_input, (grad_weight,) = local.grad_input, local.grad_params
    if grad_input is not None:
        grad_input = DTensor.from_local(
            grad_input, mesh, dx_place, shape=x_shape, stride=_contiguous_stride(x_shape)
        )
    if grad_weight is not None:
        grad_weight = DTensor.from_local(
            grad_weight, mesh, w_place, shape=weight.shape, stride=_contiguous_stride(weight.shape)
        )
    return OpBackward(grad_input, [grad_weight])


def _grad_layout(y_place: tuple) -> tuple:
    """The layout the output's gradient is needed in: the output's own, a Partial read
    as Replicate (the gradient of a sum is the same on every rank)."""
    from torch.distributed.tensor import Replicate

    return tuple(Replicate() if p.is_partial() else p for p in y_place)


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(tuple(shape)):
        stride.append(running)
        running *= size
    return tuple(reversed(stride))
