"""Dense-layer fusions: a forward-only and a backward-only fusion.

- forward: ``BasicLinear -> Bias (-> activation)`` as one ``addmm`` (plus the activation);
  each basic op's context is filled exactly as the unfused forward would fill it, so
  the unfused backward ops (or a backward fusion) run after it unchanged.
- backward: ``Bias -> activation`` backward as one pass producing the activation's
  input gradient and the bias gradient together.
"""

from __future__ import annotations

import torch

from ..basic.activations import Activation
from ..basic.linear import BasicLinear, Bias, _is_dtensor, linear_forward
from ..core.dtypes import cast
from ..core.op import BasicOperation, FusedBackward, FusedForward, FusedOperation
from ..fuser.rules import FusionContext, register_fusion, window_rule
from ..kernels.activation import activation_backward, activation_forward


class ForwardLinearBiasActivation(FusedOperation):
    """Forward of ``BasicLinear -> Bias [-> Activation]`` with the bias folded into the GEMM."""

    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs) -> FusedForward:
        linear = self.basic_ops[0]
        # tp_linear_forward with the bias: addmm in eager, bias kept out of the mm under async TP
        y = linear_forward(basic_op_ctxs[0], linear, input_, basic_op_ctxs[1].params["bias"])
        if len(self.basic_ops) == 3:
            act_ctx = basic_op_ctxs[2]
            if act_ctx.requires_grad:
                act_ctx.save_for_backward(input=y)
            y = activation_forward(self.basic_ops[2].spec, y)
        return FusedForward(y, [()] * len(self.basic_ops))


class BackwardBiasActivation(FusedOperation):
    """Backward of ``Bias -> Activation``: grad of the activation input and of the bias in one pass."""

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs) -> FusedBackward:
        bias, activation = self.basic_ops
        grad_pre = activation_backward(activation.spec, basic_op_ctxs[1].saved["input"], grad_output)
        grad_bias = None
        if basic_op_ctxs[0].needs_param_grad("bias"):
            grad_bias = cast(
                grad_pre.reshape(-1, bias.features).sum(0), basic_op_ctxs[0].params["bias"].dtype
            )
        return FusedBackward(grad_pre, [[grad_bias], []], [(), ()])


def _dense_reason(context: FusionContext, ops: list[BasicOperation]) -> str | None:
    linear = ops[0]
    if context.settings.recipe is not None:
        return f"recipe {context.settings.recipe.name}: the quantized linear runs unfused"
    if _is_dtensor(linear.weight):
        return "DTensor weight: the tensor-parallel dispatch (tp_linear_forward) runs unfused"
    if context.device.type == "cpu" and context.dtype == torch.float16:
        return "float16 addmm on CPU is not faster than mm + add"
    return None


def _build_forward(context: FusionContext, ops: list[BasicOperation], first: int):
    reason = _dense_reason(context, ops)
    if reason is not None:
        return reason
    if len(ops) == 3 and ops[2].spec.gated:
        return "gated activation after Linear+Bias: no dense GLU fusion (fused forward covers pointwise only)"
    return ForwardLinearBiasActivation(ops)


def _build_backward(context: FusionContext, ops: list[BasicOperation], first: int):
    return BackwardBiasActivation(ops)


forward_linear_bias_activation_rule = window_rule(
    "forward_linear_bias_activation", (BasicLinear, Bias, Activation), _build_forward
)
forward_linear_bias_rule = window_rule("forward_linear_bias", (BasicLinear, Bias), _build_forward)
backward_bias_activation_rule = window_rule("backward_bias_activation", (Bias, Activation), _build_backward)

register_fusion(forward_linear_bias_activation_rule, kind="forward")
register_fusion(forward_linear_bias_rule, kind="forward")
register_fusion(backward_bias_activation_rule, kind="backward")
