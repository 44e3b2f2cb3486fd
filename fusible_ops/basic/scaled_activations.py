"""Probability-scaled activations: ``act(x) * scales[:, None]`` with one extra input.

``scales`` holds one value per token row (``numel == prod(x.shape[:-1])``), e.g. the
router's probabilities; it may be fp32 while ``x`` is bf16. The gradient w.r.t.
``scales`` is returned so the router learns from it.
"""

from __future__ import annotations

import math

import torch

from ..core.op import BasicOperation, OpBackward, OperationContext, TensorMeta
from ..core.shapes import as_flat, as_rows
from ..kernels.activation import ActivationSpec, scaled_activation_backward, scaled_activation_forward
from ..kernels.grouped_checks import check_row_scales
from ..kernels.signature_checks import signature_fixes_kernel_args
from .activation_docs import gated_doc
from .activations import ClampedOptions, GatedOptions, SpecAttributes, check_activation_input


def check_op_row_scales(op_name: str, scales: object, meta: TensorMeta) -> None:
    """``scales`` must hold one floating value per token row of ``meta``, on its device."""
    check_row_scales(op_name, scales, math.prod(meta.shape[:-1]), meta.device)


class ScaledActivation(SpecAttributes, BasicOperation):
    """Base of the scaled activations; subclasses fix ``kind``."""

    kind: str = ""
    num_extra_inputs = 1

    def __init__(self, *, glu_interleave_size: int | None = None, **spec_options: float) -> None:
        super().__init__()
        self.spec = ActivationSpec(self.kind, glu_interleave_size=glu_interleave_size, **spec_options)

    def compile_facts(self) -> tuple:
        return self.spec.facts()

    def extra_repr(self) -> str:
        s = self.spec
        parts = []
        if s.kind == "clamped_swiglu":
            parts.append(f"limit={s.limit}, alpha={s.alpha}, glu_linear_offset={s.glu_linear_offset}")
        if s.glu_interleave_size is not None:
            parts.append(f"glu_interleave_size={s.glu_interleave_size}")
        return ", ".join(parts)

    static_preflight = True  # value checks, if any, are in check_values

    def preflight(self, input_meta, extra_inputs, kwargs, *, guard):
        out = check_activation_input(self.op_name(), self.spec, input_meta)
        check_op_row_scales(self.op_name(), extra_inputs[0], input_meta)
        return out

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        x = as_rows(input_, input_.shape[-1])
        flat_scales = as_flat(scales)
        out = scaled_activation_forward(self.spec, x, flat_scales)
        if ctx.requires_grad:
            ctx.save_for_backward(input=x, scales=flat_scales)
            ctx.input_shape = input_.shape
            ctx.scales_shape = scales.shape
            ctx.scales_requires_grad = scales.requires_grad
        return out.view(*input_.shape[:-1], out.shape[-1])

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor) -> OpBackward:
        dy = as_rows(grad_output, grad_output.shape[-1])
        grad_input, grad_scales = scaled_activation_backward(
            self.spec, ctx.saved["input"], ctx.saved["scales"], dy
        )
        grad_scales = grad_scales.view(ctx.scales_shape) if ctx.scales_requires_grad else None
        return OpBackward(grad_input.view(ctx.input_shape), (), (grad_scales,))


@signature_fixes_kernel_args
@gated_doc(
    """``y = silu(gate) * linear * scales[:, None]``: :class:`~fusible_ops.SwiGLU` times
    one scale per token row.""",
    scaled=True,
)
class ScaledSwiGLU(GatedOptions, ScaledActivation):
    kind = "swiglu"


@signature_fixes_kernel_args
@gated_doc(
    """``y = gelu_tanh(gate) * linear * scales[:, None]``: :class:`~fusible_ops.GEGLU`
    times one scale per token row.""",
    scaled=True,
)
class ScaledGEGLU(GatedOptions, ScaledActivation):
    kind = "geglu"


@signature_fixes_kernel_args
@gated_doc(
    """:class:`~fusible_ops.ClampedSwiGLU` times one scale per token row:
    ``y = g * sigmoid(alpha * g) * (l + glu_linear_offset) * scales[:, None]`` with
    ``g = min(gate, limit)``, ``l = clamp(linear, -limit, limit)``.""",
    scaled=True,
    clamped=True,
)
class ScaledClampedSwiGLU(ClampedOptions, ScaledActivation):
    kind = "clamped_swiglu"


@signature_fixes_kernel_args
class ScaledSReLU(ScaledActivation):
    """``y = relu(x) ** 2 * scales[:, None]``: :class:`~fusible_ops.SReLU` times one scale
    per token row.

    Shape:
        input: ``[..., n]``, floating point.
        scales: extra input, one value per token row (``prod(input.shape[:-1])``
            values, e.g. ``[rows]`` or ``[rows, 1]``), floating point (may be fp32 with a
            bf16 input), on the input's device; its gradient is returned too.
        output: ``[..., n]``, the input's dtype.
    """

    kind = "srelu"

    def __init__(self) -> None:
        super().__init__()
