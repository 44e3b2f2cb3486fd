"""Normalisation ops over the last dim: RMSNorm and LayerNorm.

Backward recomputes the (cheap) normalisation from the saved input and differentiates
it with autograd, so only the input is kept for backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.op import BasicOperation, OpBackward, OperationContext, TensorMeta
from .grouped_linear import check_feature_op


class _Norm(BasicOperation):
    def __init__(self, normalized_shape: int, eps: float, *, device=None, dtype=None) -> None:
        super().__init__()
        self.normalized_shape = int(normalized_shape)
        self.eps = float(eps)
        self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"

    static_preflight = True  # value checks, if any, are in check_values

    def preflight(self, input_meta: TensorMeta, extra_inputs, kwargs, *, guard) -> TensorMeta:
        names = self.param_names or ("weight",)
        params = {name: getattr(self, name) for name in names}
        check_feature_op(self.op_name(), input_meta, self.normalized_shape, params)
        return input_meta

    def _norm(self, x: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor) -> torch.Tensor:
        if ctx.requires_grad:
            ctx.save_for_backward(input=input_)
        return self._norm(input_, [t for t in ctx.params.values() if t is not None])

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor) -> OpBackward:
        params = {n: t for n, t in ctx.params.items() if t is not None}
        with torch.enable_grad():
            x = ctx.saved["input"].detach().requires_grad_(ctx.input_requires_grad)
            leaves = [t.detach().requires_grad_(ctx.needs_param_grad(n)) for n, t in params.items()]
            y = self._norm(x, leaves)
            wanted = [t for t in (x, *leaves) if t.requires_grad]
            grads = iter(torch.autograd.grad(y, wanted, grad_output)) if wanted else iter(())
        grad_input = next(grads) if x.requires_grad else None
        grad_params = [next(grads) if leaf.requires_grad else None for leaf in leaves]
        return OpBackward(grad_input, grad_params)


class RMSNorm(_Norm):
    """``y = x / sqrt(mean(x**2) + eps) * weight``, over the last dim.

    The learnable ``weight`` ``[normalized_shape]`` starts as ones.

    Args:
        normalized_shape: the size of the last dim (an int), and of ``weight``.
        eps: added to the mean square for numerical stability. Default: 1e-6.
        device: where the parameter is made. Default: torch's default device.
        dtype: the parameter's dtype. Default: torch's default dtype.

    Shape:
        input: ``[..., normalized_shape]``, floating point, on the weight's device.
        output: ``[..., normalized_shape]``, same shape as the input.
    """

    param_names = ("weight",)

    def __init__(self, normalized_shape: int, eps: float = 1e-6, *, device=None, dtype=None) -> None:
        super().__init__(normalized_shape, eps, device=device, dtype=dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-initialize the parameters as at construction."""
        torch.nn.init.ones_(self.weight)

    def _norm(self, x, params):
        return F.rms_norm(x, (self.normalized_shape,), params[0], self.eps)


class LayerNorm(_Norm):
    """``y = (x - mean) / sqrt(var + eps) * weight + bias``, over the last dim (biased variance).

    The learnable ``weight`` and ``bias``, each ``[normalized_shape]``, start as ones and zeros.

    Args:
        normalized_shape: the size of the last dim (an int), and of ``weight`` and ``bias``.
        eps: added to the variance for numerical stability. Default: 1e-5.
        device: where the parameters are made. Default: torch's default device.
        dtype: the parameters' dtype. Default: torch's default dtype.

    Shape:
        input: ``[..., normalized_shape]``, floating point, on the parameters' device.
        output: ``[..., normalized_shape]``, same shape as the input.
    """

    param_names = ("weight", "bias")

    def __init__(self, normalized_shape: int, eps: float = 1e-5, *, device=None, dtype=None) -> None:
        super().__init__(normalized_shape, eps, device=device, dtype=dtype)
        self.bias = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-initialize the parameters as at construction."""
        torch.nn.init.ones_(self.weight)
        torch.nn.init.zeros_(self.bias)

    def _norm(self, x, params):
        return F.layer_norm(x, (self.normalized_shape,), params[0], params[1], self.eps)
