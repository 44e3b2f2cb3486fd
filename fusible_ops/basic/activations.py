"""Pointwise activations and gated linear units (GLU family).

Gated ops read the gate from the first half of the last dim and the linear part from
the second half, or with ``glu_interleave_size=k`` from alternating blocks of ``k``
columns. Shapes: input ``[..., 2n]`` -> output ``[..., n]`` (gated), ``[..., n]`` ->
``[..., n]`` otherwise.
"""

from __future__ import annotations

import torch

from ..core.op import BasicOperation, OpBackward, OperationContext, TensorMeta, fixed_at_construction
from ..kernels.activation import ActivationSpec, activation_backward, activation_forward
from ..kernels.signature_checks import signature_fixes_kernel_args
from .activation_docs import gated_doc


def check_activation_input(op_name: str, spec: ActivationSpec, meta: TensorMeta) -> TensorMeta:
    """Validate the last dim for ``spec``; return the output meta."""
    if not meta.dtype.is_floating_point:
        raise ValueError(f"{op_name}: input must be floating point, got {meta.dtype}")
    if len(meta.shape) < 1:
        raise ValueError(f"{op_name}: input must have at least 1 dim")
    if not spec.gated:
        return meta
    spec.check_width(op_name, meta.shape[-1])
    return TensorMeta((*meta.shape[:-1], spec.output_features(meta.shape[-1])), meta.dtype, meta.device)


def _spec_field(name: str) -> property:
    return fixed_at_construction(
        name, f"The activation's ``{name}`` (read-only).", lambda self: getattr(self.spec, name)
    )


class SpecAttributes:
    """The activation options of an op holding an ``ActivationSpec``, read-only."""

    spec = fixed_at_construction("spec", "What the activation computes (an ``ActivationSpec``).")
    limit = _spec_field("limit")
    alpha = _spec_field("alpha")
    glu_linear_offset = _spec_field("glu_linear_offset")
    glu_interleave_size = _spec_field("glu_interleave_size")


class GatedOptions:
    """The constructor of the gated ops whose only option is ``glu_interleave_size``."""

    def __init__(self, *, glu_interleave_size: int | None = None) -> None:
        super().__init__(glu_interleave_size=glu_interleave_size)


class ClampedOptions:
    """The constructor and ``repr`` of the clamped SwiGLU ops (plain and scaled)."""

    def __init__(
        self,
        limit: float = 7.0,
        alpha: float = 1.702,
        glu_linear_offset: float = 1.0,
        glu_interleave_size: int | None = None,
    ) -> None:
        super().__init__(
            glu_interleave_size=glu_interleave_size,
            limit=limit,
            alpha=alpha,
            glu_linear_offset=glu_linear_offset,
        )

    def extra_repr(self) -> str:
        s = self.spec
        text = f"limit={s.limit}, alpha={s.alpha}, glu_linear_offset={s.glu_linear_offset}"
        return text + (f", glu_interleave_size={s.glu_interleave_size}" if s.glu_interleave_size else "")


class Activation(SpecAttributes, BasicOperation):
    """Base of the activation ops; subclasses fix ``kind`` (and gated options)."""

    kind: str = ""

    def __init__(self, *, glu_interleave_size: int | None = None, **spec_options: float) -> None:
        super().__init__()
        self.spec = ActivationSpec(self.kind, glu_interleave_size=glu_interleave_size, **spec_options)

    def compile_facts(self) -> tuple:
        return self.spec.facts()

    def extra_repr(self) -> str:
        if self.spec.glu_interleave_size is None:
            return ""
        return f"glu_interleave_size={self.spec.glu_interleave_size}"

    static_preflight = True  # value checks, if any, are in check_values

    def preflight(self, input_meta, extra_inputs, kwargs, *, guard):
        return check_activation_input(self.op_name(), self.spec, input_meta)

    def op_forward(self, ctx: OperationContext, input_: torch.Tensor) -> torch.Tensor:
        if ctx.requires_grad:
            ctx.save_for_backward(input=input_)
        return activation_forward(self.spec, input_)

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor) -> OpBackward:
        return OpBackward(activation_backward(self.spec, ctx.saved["input"], grad_output))


@signature_fixes_kernel_args
class ReLU(Activation):
    """``y = max(x, 0)``, elementwise.

    Shape:
        input: ``[..., n]``, floating point.
        output: ``[..., n]``, the input's dtype.
    """

    kind = "relu"

    def __init__(self) -> None:
        super().__init__()


@signature_fixes_kernel_args
class GELU(Activation):
    """GELU, tanh approximation:
    ``y = 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))``, elementwise.

    Shape:
        input: ``[..., n]``, floating point.
        output: ``[..., n]``, the input's dtype.
    """

    kind = "gelu"

    def __init__(self) -> None:
        super().__init__()


@signature_fixes_kernel_args
class SiLU(Activation):
    """``y = x * sigmoid(x)``, elementwise.

    Shape:
        input: ``[..., n]``, floating point.
        output: ``[..., n]``, the input's dtype.
    """

    kind = "silu"

    def __init__(self) -> None:
        super().__init__()


@signature_fixes_kernel_args
class SReLU(Activation):
    """Squared ReLU: ``y = relu(x) ** 2``, elementwise.

    Shape:
        input: ``[..., n]``, floating point.
        output: ``[..., n]``, the input's dtype.
    """

    kind = "srelu"

    def __init__(self) -> None:
        super().__init__()


@signature_fixes_kernel_args
@gated_doc("""``y = silu(gate) * linear``, a gated linear unit over the last dim.""")
class SwiGLU(GatedOptions, Activation):
    kind = "swiglu"


@signature_fixes_kernel_args
@gated_doc("""``y = gelu_tanh(gate) * linear``, a gated linear unit over the last dim.""")
class GEGLU(GatedOptions, Activation):
    kind = "geglu"


@signature_fixes_kernel_args
@gated_doc("""``y = relu(gate) * linear``, a gated linear unit over the last dim.""")
class ReGLU(GatedOptions, Activation):
    kind = "reglu"


@signature_fixes_kernel_args
@gated_doc(
    """GPT-OSS style clamped SwiGLU: ``g = min(gate, limit)``,
    ``l = clamp(linear, -limit, limit)``, ``y = g * sigmoid(alpha * g) * (l + glu_linear_offset)``.""",
    clamped=True,
)
class ClampedSwiGLU(ClampedOptions, Activation):
    kind = "clamped_swiglu"
