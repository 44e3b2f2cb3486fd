"""Dense linear layer as two basic ops: ``BasicLinear`` (the GEMM) and ``Bias``.

``BasicLinear`` computes through :func:`fusible_ops.basic.linear_dispatch.tp_linear_forward`,
so DTensor weights (tensor parallelism) work eagerly and under ``torch.compile``.
"""

from __future__ import annotations

import math

import torch

from ..core.dtypes import cast, compute_dtype, compute_dtype_of
from ..core.op import BasicOperation, OpBackward, OperationContext, TensorMeta, check_sizes
from ..kernels.quantized import QuantizedChoice, select_quantized
from . import quantized_linear, quantized_tp_linear
from .grouped_linear import check_feature_op, check_float_input, check_params
from .linear_dispatch import tp_linear_forward


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


class BasicLinear(BasicOperation):
    """``y = x @ weight.T``: the GEMM of a dense linear layer, without bias.

    The learnable ``weight`` is ``[out_features, in_features]``, initialised as
    ``torch.nn.Linear``'s; it may be a DTensor (tensor parallelism). Follow it with
    :class:`~fusible_ops.Bias` for a bias (:class:`~fusible_ops.Linear` is the pair).

    Args:
        in_features: the size of each input row, a positive int.
        out_features: the size of each output row, a positive int.
        device: where the weight is made. Default: torch's default device.
        dtype: the weight's dtype. Default: torch's default dtype.

    Shape:
        input: ``[..., in_features]``, floating point, the weight's dtype (any floating
            dtype but float64 under autocast) and device.
        output: ``[..., out_features]``, the input's dtype (autocast's under autocast).
    """

    param_names = ("weight",)
    accepts_dtensor = True

    def __init__(self, in_features: int, out_features: int, *, device=None, dtype=None) -> None:
        super().__init__()
        check_sizes("BasicLinear", in_features=in_features, out_features=out_features)
        self.in_features = in_features
        self.out_features = out_features
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-initialize the parameters as at construction."""
        torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

    def plan_quantized(self, device: torch.device, dtype: torch.dtype, settings) -> QuantizedChoice:
        """How this op's GEMMs run under ``settings.recipe`` (see ``fusible_ops.recipes``;
        a DTensor weight: ``fusible_ops.basic.quantized_tp_linear``)."""
        return select_quantized(settings.recipe, device, dtype, grouped=False, engine=settings.recipe_backend)

    static_preflight = True  # value checks, if any, are in check_values

    def preflight(self, input_meta: TensorMeta, extra_inputs, kwargs, *, guard) -> TensorMeta:
        out_shape = (*input_meta.shape[:-1], self.out_features)
        check_params(
            self.op_name(), {"weight": self.weight}, {"weight": (self.out_features, self.in_features)}
        )
        if _is_dtensor(self.weight):
            return TensorMeta(out_shape, input_meta.dtype, input_meta.device)
        check_float_input(self.op_name(), input_meta, self.weight, self.in_features)
        return TensorMeta(out_shape, compute_dtype(input_meta.dtype, input_meta.device), input_meta.device)

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor) -> torch.Tensor:
        return linear_forward(ctx, self, input_, None)

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor) -> OpBackward:
        if getattr(ctx, "quantized", None) is not None:
            if getattr(ctx, "tensor_parallel", False):
                return quantized_tp_linear.backward(self, ctx, grad_output)
            return quantized_linear.linear_backward(self, ctx, grad_output)
        x, weight = ctx.saved["input"], ctx.params["weight"]
        if _is_dtensor(weight):
            return _autograd_linear_backward(ctx, x, weight, grad_output)
        dtype = ctx.compute_dtype
        dy = cast(grad_output, dtype)
        grad_input = grad_weight = None
        if ctx.input_requires_grad:
            grad_input = dy @ cast(weight, dtype)
        if ctx.needs_param_grad("weight"):
            dy2d = dy.reshape(-1, self.out_features)
            grad_weight = cast(dy2d.t() @ x.reshape(-1, self.in_features), weight.dtype)
        return OpBackward(grad_input, [grad_weight])


def linear_forward(
    ctx: OperationContext, linear: BasicLinear, input_: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``BasicLinear``'s forward (optionally with a bias folded in), filling its context.

    Under autocast the input and weight are cast to autocast's dtype; DTensor weights
    are left to DTensor. Everything goes through ``tp_linear_forward``.
    """
    weight = ctx.params["weight"]
    if _is_dtensor(weight):
        dtype = input_.dtype
        if type(ctx.backend_choice) is QuantizedChoice:
            ctx.tensor_parallel = True
            return quantized_tp_linear.forward(ctx, linear, ctx.backend_choice, input_, weight, bias)
    else:
        dtype = compute_dtype_of(input_)
        input_, weight, bias = cast(input_, dtype), cast(weight, dtype), cast(bias, dtype)
        if type(ctx.backend_choice) is QuantizedChoice:
            return quantized_linear.linear_forward(ctx, linear, ctx.backend_choice, input_, weight, bias)
    if ctx.requires_grad:
        # the fuser saves the weight with every parameter of the call
        keep_input = ctx.needs_param_grad("weight") or _is_dtensor(weight)
        ctx.save_for_backward(input=input_ if keep_input else None)
        ctx.compute_dtype = dtype
    return tp_linear_forward(input_, weight, bias, mm_for_2d_compile=False)


def _autograd_linear_backward(ctx, x, weight, grad_output):
    """DTensor weights: the gradients of ``x @ weight.T`` written as the ops autograd's own
    formulas use (``dy @ W`` and ``dyᵀ x``, summed over leading dims), so DTensor propagates
    the placements exactly as it would differentiating the forward, and ``torch.compile``
    traces them (``torch.autograd.grad`` inside a backward would break the graph)."""
    grad_input = grad_weight = None
    if ctx.input_requires_grad:
        grad_input = torch.matmul(grad_output, weight)
    if ctx.params_require_grad:
        if grad_output.dim() == 2:
            grad_weight = torch.matmul(grad_output.t(), x)
        else:
            per_batch = torch.matmul(grad_output.transpose(-2, -1), x)  # [..., out, in]
            grad_weight = per_batch.sum(dim=tuple(range(per_batch.dim() - 2)))
    return OpBackward(grad_input, [grad_weight])


class Bias(BasicOperation):
    """``y = x + bias``, with the bias added over the last dim.

    The learnable ``bias`` is ``[features]``, initialised to zeros. It may be a DTensor
    (tensor parallelism).

    Args:
        features: the size of the last dim, a positive int.
        device: where the bias is made. Default: torch's default device.
        dtype: the bias's dtype. Default: torch's default dtype.

    Shape:
        input: ``[..., features]``.
        output: ``[..., features]``.
    """

    param_names = ("bias",)
    accepts_dtensor = True

    def __init__(self, features: int, *, device=None, dtype=None) -> None:
        super().__init__()
        check_sizes("Bias", features=features)
        self.features = features
        self.bias = torch.nn.Parameter(torch.empty(features, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-initialize the parameters as at construction."""
        torch.nn.init.zeros_(self.bias)

    def extra_repr(self) -> str:
        return f"features={self.features}"

    static_preflight = True  # value checks, if any, are in check_values

    def preflight(self, input_meta: TensorMeta, extra_inputs, kwargs, *, guard) -> TensorMeta:
        check_feature_op(self.op_name(), input_meta, self.features, {"bias": self.bias})
        return input_meta

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor) -> torch.Tensor:
        bias = ctx.params["bias"]
        if torch.is_autocast_enabled(input_.device.type):
            bias = cast(bias, input_.dtype)  # keep autocast's dtype, as torch.nn.Linear does
        return input_ + bias

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor) -> OpBackward:
        grad_bias = None
        if ctx.needs_param_grad("bias"):
            grad_bias = cast(grad_output.reshape(-1, self.features).sum(0), ctx.params["bias"].dtype)
        return OpBackward(grad_output, [grad_bias])
