"""GroupedMLP: the MoE expert block as one joint fused op, and the rules that build it.

Patterns (joint fusion, forward and backward):

- ``GroupedLinear -> Scaled{SwiGLU,GEGLU,ClampedSwiGLU,SReLU} -> GroupedLinear``
- ``GroupedLinear -> {SwiGLU,GEGLU,ClampedSwiGLU,SReLU} -> GroupedLinear -> Scale``
  (routing weight applied after the down projection and its bias)
- with fc1 a ``GroupedGateUpLinear`` (separate gate and up weights): both patterns above with
  a gated activation, and ``GroupedGateUpLinear -> {SwiGLU,GEGLU,ClampedSwiGLU} ->
  GroupedLinear`` without routing weights (see ``grouped_mlp_gate_up``)

Saved for backward: the input, fc1's output (pre-activation), the scales and the
group offsets; the activation is recomputed in backward. fc2's ``output`` buffer and
fc1's ``grad_input`` buffer are written in place by the kernels.
"""

from __future__ import annotations

from typing import Any

from ..basic.activations import Activation
from ..basic.gate_up_gemms import PlainGemms, block_gemms
from ..basic.grouped_gate_up import GroupedGateUpLinear
from ..basic.grouped_linear import GroupedLinear
from ..basic.scale import Scale
from ..basic.scaled_activations import ScaledActivation
from ..core.buffers import GRAD_INPUT_BUFFER_KEY, OUTPUT_BUFFER_KEY, buffer_rows
from ..core.dtypes import cast, compute_dtype_of
from ..core.op import BasicOperation, FusedBackward, FusedForward, FusedOperation, OperationContext
from ..core.shapes import as_flat, as_rows
from ..core.splits import SplitInfo, to_split_info
from ..fuser.rules import FusionContext, register_fusion, window_rule
from ..kernels import BackendChoice, select_backend
from ..kernels import library as kernel_ops
from ..kernels.activation import EXPERT_BLOCK_KINDS, ActivationSpec
from ..kernels.quantized import QuantizedChoice, select_quantized
from ..kernels.signature_checks import signature_fixes_kernel_args
from ..recipes.quantize import QUANTIZED_INPUT_KEY, check_quantized_input
from . import grouped_mlp_gate_up, grouped_mlp_quantized
from .grouped_mlp_bound import bind_grouped_mlp

SUPPORTED_ACTIVATIONS = EXPERT_BLOCK_KINDS  # read from the activation table


@signature_fixes_kernel_args
class GroupedMLP(FusedOperation):
    """fc1 -> (scaled) activation -> fc2 (-> Scale), computed by one kernel backend.

    The fuser builds it (rules ``grouped_mlp`` and ``grouped_mlp_scale_after_fc2``) for
    ``GroupedLinear -> Scaled{SwiGLU,GEGLU,ClampedSwiGLU,SReLU} -> GroupedLinear`` or
    ``GroupedLinear -> {SwiGLU,GEGLU,ClampedSwiGLU,SReLU} -> GroupedLinear -> Scale``;
    it uses those ops' parameters and gives their results. The backend choice
    (``choice``; ``backend`` is its name) is fixed when the plan is made and is what runs.

    Args:
        basic_ops: the window's ops: fc1 (``GroupedLinear``), the activation, fc2
            (``GroupedLinear``) and, with ``scale_after_fc2``, ``Scale``.
        choice: the kernel backend (a ``BackendChoice`` from ``select_backend``).
        scale_after_fc2: True for the second pattern (routing weights applied after fc2
            and its bias), False for the first.
        quantized: how the GEMMs run under a low-precision recipe, or None (default):
            unquantized.

    Shape:
        input: ``[..., K]`` (fc1's ``in_features``), token rows sorted by group.
        extra inputs: in op order, ``split_sizes`` ``[G]`` (fc1), ``scales``
            (one per row, e.g. ``[rows]``; the scaled activation), ``split_sizes`` ``[G]``
            (fc2, the same as fc1's); with ``scale_after_fc2``: ``split_sizes``, nothing,
            ``split_sizes``, ``scales``.
        output: ``[..., H]`` (fc2's ``out_features``).
    """

    def __init__(
        self,
        basic_ops: list[BasicOperation],
        choice: BackendChoice,
        *,
        scale_after_fc2: bool,
        quantized: QuantizedChoice | None = None,
        scaled: bool = True,
    ) -> None:
        super().__init__(basic_ops, backend=choice)
        #: how the GEMMs run under a low-precision recipe, or None when unquantized
        self.quantized = quantized
        self.fc1: GroupedLinear = basic_ops[0]
        self.activation_op = basic_ops[1]
        self.fc2: GroupedLinear = basic_ops[2]
        self.spec: ActivationSpec = basic_ops[1].spec
        self.scale_after_fc2 = scale_after_fc2
        #: False for a block without routing weights (fc1 with separate gate and up weights only)
        self.scaled = scaled
        #: whether fc1 keeps its gate and up weights apart (a GroupedGateUpLinear, two fc1 GEMMs)
        self.gate_up = isinstance(self.fc1, GroupedGateUpLinear)

    def _scales_position(self) -> int:
        return 3 if self.scale_after_fc2 else 1

    def _gate_up_gemms(self, p1: dict, p2: dict, dtype: Any) -> PlainGemms:
        """The block's GEMMs: quantized under the plan's recipe, else on its backend."""
        choice = self.choice if self.quantized is None else self.quantized
        params = (p1["gate_weight"], p1["up_weight"], p2["weight"])
        return block_gemms(choice, params, self.fc1.op_name(), dtype)

    def _gate_up_forward(self, basic_op_ctxs, input_, extra_inputs, kwargs) -> FusedForward:
        ctx1, p1, p2 = basic_op_ctxs[0], basic_op_ctxs[0].params, basic_op_ctxs[2].params
        dtype = compute_dtype_of(input_)
        x = cast(as_rows(input_, self.fc1.in_features), dtype)
        weights = (
            cast(p1["gate_weight"], dtype),
            cast(p1["up_weight"], dtype),
            cast(self.fc2.weight_out_in(p2["weight"]), dtype),
        )
        splits = to_split_info(extra_inputs[0][0], x.shape[0], x)
        scales_in = extra_inputs[self._scales_position()][0] if self.scaled else None
        scales = None if scales_in is None else as_flat(scales_in)
        out2d = buffer_rows(kwargs[2].get(OUTPUT_BUFFER_KEY), x.shape[0], self.fc2.out_features)
        save = any([c.requires_grad for c in basic_op_ctxs])
        gemms = self._gate_up_gemms(p1, p2, dtype)
        y = grouped_mlp_gate_up.mlp_forward(
            self, ctx1, gemms, x, weights, cast(p2["bias"], dtype), scales, splits, out2d, save
        )
        if save:
            self._keep_call_facts(ctx1, splits, input_, dtype, scales_in)
        out_shape = (*input_.shape[:-1], self.fc2.out_features)
        return FusedForward(y if y.shape == out_shape else y.view(out_shape), [()] * len(basic_op_ctxs))

    def _gate_up_backward(self, basic_op_ctxs, grad_output) -> FusedBackward:
        ctx1, ctx2 = basic_op_ctxs[0], basic_op_ctxs[2]
        p1, p2, dtype = ctx1.params, ctx2.params, ctx1.compute_dtype
        weights = (
            cast(p1["gate_weight"], dtype),
            cast(p1["up_weight"], dtype),
            cast(self.fc2.weight_out_in(p2["weight"]), dtype),
        )
        dy = cast(as_rows(grad_output, self.fc2.out_features), dtype)
        if not dy.is_contiguous():
            dy = dy.contiguous()
        needs = (
            ctx1.input_requires_grad,
            ctx1.needs_param_grad("gate_weight"),
            ctx1.needs_param_grad("up_weight"),
            ctx2.needs_param_grad("weight"),
            ctx2.needs_param_grad("bias"),
            bool(ctx1.scales_requires_grad),
        )
        out = buffer_rows(ctx1.grad_input_buffer, dy.shape[0], self.fc1.in_features) if needs[0] else None
        grad_input, grad_fc1, grad_w2, grad_b2, grad_scales = grouped_mlp_gate_up.mlp_backward(
            self, ctx1, self._gate_up_gemms(p1, p2, dtype), dy, weights, needs, out
        )
        if grad_input is not None and grad_input.shape != ctx1.input_shape:
            grad_input = grad_input.view(ctx1.input_shape)
        if grad_scales is not None and grad_scales.shape != ctx1.scales_shape:
            grad_scales = grad_scales.view(ctx1.scales_shape)
        fc1_grads = [cast(g, p1[n].dtype) for g, n in zip(grad_fc1, ("gate_weight", "up_weight"))]
        grad_params = [fc1_grads, [], _param_grads(p2, _in_layout(self.fc2, grad_w2), grad_b2)]
        grad_extra: list[tuple[Any, ...]] = [(None,), (), (None,)]
        if self.scale_after_fc2:
            grad_params.append([])
            grad_extra.append((grad_scales,))
        elif self.scaled:
            grad_extra[1] = (grad_scales,)
        return FusedBackward(grad_input, grad_params, grad_extra)

    def bind_call(self, input_, extra_inputs: tuple, param_dicts: list, grad_flags: list | None):
        """This op bound to one call signature (see ``fusible_ops.fuser.fast_path``), or None."""
        return bind_grouped_mlp(self, input_, extra_inputs, param_dicts, grad_flags)

    # ------------------------------------------------------------ forward
    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs) -> FusedForward:
        if self.gate_up:
            return self._gate_up_forward(basic_op_ctxs, input_, basic_op_extra_inputs, basic_op_kwargs)
        fc1, fc2 = self.fc1, self.fc2
        ctx1: OperationContext = basic_op_ctxs[0]
        p1, p2 = basic_op_ctxs[0].params, basic_op_ctxs[2].params
        dtype = compute_dtype_of(input_)
        x = cast(as_rows(input_, fc1.in_features), dtype)
        w1, w2 = cast(fc1.weight_out_in(p1["weight"]), dtype), cast(fc2.weight_out_in(p2["weight"]), dtype)
        b1, b2 = cast(p1["bias"], dtype), cast(p2["bias"], dtype)
        splits = to_split_info(basic_op_extra_inputs[0][0], x.shape[0], x)
        scales_in = basic_op_extra_inputs[self._scales_position()][0]
        scales = as_flat(scales_in)
        out_shape = (*input_.shape[:-1], fc2.out_features)
        # buffers were checked in preflight: only the first rows are taken here
        out2d = buffer_rows(basic_op_kwargs[2].get(OUTPUT_BUFFER_KEY), x.shape[0], fc2.out_features)
        x_q = basic_op_kwargs[0].get(QUANTIZED_INPUT_KEY)
        if self.quantized is not None:
            save = any([c.requires_grad for c in basic_op_ctxs])
            weights = (p1["weight"], w1, p2["weight"], w2)
            y = grouped_mlp_quantized.mlp_forward(
                self, ctx1, self.quantized, x, weights, b1, b2, scales, splits, out2d, save, x_q
            )
            if save:
                self._keep_call_facts(ctx1, splits, input_, dtype, scales_in)
            return FusedForward(y if y.shape == out_shape else y.view(out_shape), [()] * len(basic_op_ctxs))
        if x_q is not None:
            check_quantized_input(fc1.op_name(), x_q, None, x, splits.offsets)
        pre, y = kernel_ops.mlp_forward(
            self.choice.backend, x, w1, b1, w2, b2, scales, splits, self.spec,
            scale_after_fc2=self.scale_after_fc2, out=out2d,
        )  # fmt: skip
        if any([c.requires_grad for c in basic_op_ctxs]):  # a list: no generator per call
            ctx1.save_for_backward(
                x=x if ctx1.needs_param_grad("weight") else None,
                pre=pre,
                scales=scales,
                offsets=splits.offsets,
                host_sizes=splits.host_sizes,
            )
            self._keep_call_facts(ctx1, splits, input_, dtype, scales_in)
        extra_outputs = [()] * len(basic_op_ctxs)
        return FusedForward(y if y.shape == out_shape else y.view(out_shape), extra_outputs)

    @staticmethod
    def _keep_call_facts(ctx1: OperationContext, splits, input_, dtype, scales_in) -> None:
        ctx1.host_splits = splits.host
        ctx1.input_shape = input_.shape
        ctx1.compute_dtype = dtype
        ctx1.scales_shape = None if scales_in is None else scales_in.shape
        ctx1.scales_requires_grad = scales_in is not None and scales_in.requires_grad

    # ------------------------------------------------------------ backward
    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs) -> FusedBackward:
        if self.gate_up:
            return self._gate_up_backward(basic_op_ctxs, grad_output)
        fc1, fc2 = self.fc1, self.fc2
        ctx1: OperationContext = basic_op_ctxs[0]
        ctx2: OperationContext = basic_op_ctxs[2]
        saved = ctx1.saved
        splits = SplitInfo(ctx1.host_splits, saved["offsets"], saved["host_sizes"])
        dtype = ctx1.compute_dtype
        p1, p2 = ctx1.params, ctx2.params
        w1, w2 = cast(fc1.weight_out_in(p1["weight"]), dtype), cast(fc2.weight_out_in(p2["weight"]), dtype)
        b2 = cast(p2["bias"], dtype)
        dy = cast(as_rows(grad_output, fc2.out_features), dtype)
        if not dy.is_contiguous():
            dy = dy.contiguous()
        needs = (
            ctx1.input_requires_grad,
            ctx1.needs_param_grad("weight"),
            ctx1.needs_param_grad("bias"),
            ctx2.needs_param_grad("weight"),
            ctx2.needs_param_grad("bias"),
            ctx1.scales_requires_grad,
        )
        out = buffer_rows(ctx1.grad_input_buffer, dy.shape[0], fc1.in_features) if needs[0] else None
        if self.quantized is not None:
            weights = (p1["weight"], w1, p2["weight"], w2)
            grads = grouped_mlp_quantized.mlp_backward(self, ctx1, self.quantized, dy, weights, needs, out)
        else:
            grads = kernel_ops.mlp_backward(
                self.choice.backend, dy, saved["x"], saved["pre"], w1, w2, b2, saved["scales"], splits, self.spec,
                scale_after_fc2=self.scale_after_fc2, needs=needs, grad_input_out=out,
            )  # fmt: skip
        grad_input, grad_w1, grad_b1, grad_w2, grad_b2, grad_scales = grads
        if grad_input is not None and grad_input.shape != ctx1.input_shape:
            grad_input = grad_input.view(ctx1.input_shape)
        if grad_scales is not None and grad_scales.shape != ctx1.scales_shape:
            grad_scales = grad_scales.view(ctx1.scales_shape)
        grad_params = [
            _param_grads(p1, _in_layout(fc1, grad_w1), grad_b1),
            [],
            _param_grads(p2, _in_layout(fc2, grad_w2), grad_b2),
        ]
        grad_extra: list[tuple[Any, ...]] = [(None,), (), (None,)]
        if self.scale_after_fc2:
            grad_params.append([])
            grad_extra.append((grad_scales,))
        else:
            grad_extra[1] = (grad_scales,)
        return FusedBackward(grad_input, grad_params, grad_extra)


def _in_layout(fc: GroupedLinear, grad_weight):
    """A ``[G, N, K]`` weight gradient in ``fc``'s layout (for in_out a transposed view,
    which autograd lays out like the parameter when it accumulates)."""
    return None if grad_weight is None else fc.weight_out_in(grad_weight)


def _param_grads(params: dict, grad_weight, grad_bias) -> list:
    """Gradients in the parameters' own dtypes (they differ under autocast)."""
    grad_weight = cast(grad_weight, params["weight"].dtype)
    bias = params["bias"]
    return [grad_weight] if bias is None else [grad_weight, cast(grad_bias, bias.dtype)]


# ---------------------------------------------------------------- rules


def _supported_classes(family: type) -> list[str]:
    """Names of the activation classes of ``family`` whose kind GroupedMLP fuses."""
    found, pending = set(), [family]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if getattr(cls, "kind", "") in SUPPORTED_ACTIVATIONS:
            found.add(cls.__name__)
    return sorted(found)


def _check_mlp(context: FusionContext, ops: list[BasicOperation], first: int) -> str | None:
    """The reason the window cannot be fused, or None."""
    fc1, activation, fc2 = ops[0], ops[1], ops[2]
    spec: ActivationSpec = activation.spec
    if spec.kind not in SUPPORTED_ACTIVATIONS:
        family = ScaledActivation if isinstance(activation, ScaledActivation) else Activation
        return (
            f"activation {activation.op_name()} ({spec.kind}) is not supported by GroupedMLP; "
            f"supported here: {', '.join(_supported_classes(family))}"
        )
    if isinstance(fc1, GroupedGateUpLinear):
        if not spec.gated or spec.glu_interleave_size is not None:
            return (
                f"{activation.op_name()} does not read fc1's output as [gate | up] halves, which "
                "separate gate and up weights make"
            )
    if fc1.num_groups != fc2.num_groups:
        return f"fc1.num_groups ({fc1.num_groups}) != fc2.num_groups ({fc2.num_groups})"
    if spec.gated and fc1.out_features != 2 * fc2.in_features:
        return f"fc1.out_features ({fc1.out_features}) != 2*fc2.in_features ({2 * fc2.in_features})"
    if not spec.gated and fc1.out_features != fc2.in_features:
        return f"fc1.out_features ({fc1.out_features}) != fc2.in_features ({fc2.in_features})"
    if fc1.weight.dtype != fc2.weight.dtype or fc1.weight.device != fc2.weight.device:
        return "fc1 and fc2 weights differ in dtype or device"
    if context.has_kwarg(first, OUTPUT_BUFFER_KEY):
        return (
            "output buffer requested on fc1 (the fused op does not materialise fc1's output for the caller)"
        )
    if len(ops) == 4 and context.has_kwarg(first + 2, OUTPUT_BUFFER_KEY):
        return (
            "output buffer requested on fc2 with Scale after it: unfused, the buffer holds fc2's "
            "unscaled output; request the buffer on a pattern with the scale before fc2"
        )
    if context.has_kwarg(first + 2, GRAD_INPUT_BUFFER_KEY):
        return "grad_input buffer requested on fc2 (the fused op does not materialise fc2's input gradient)"
    if not context.same_extra_input((first, 0), (first + 2, 0)):
        kinds = {context.extra_input_kinds[first][0], context.extra_input_kinds[first + 2][0]}
        if kinds & {"list", "cpu tensor"} == kinds:
            return "fc1 and fc2 receive different split sizes"
        return (
            "fc1 and fc2 receive different split-size objects on the device; comparing them would need a "
            "host sync (pass the same tensor to both)"
        )
    return None


def _build(scale_after_fc2: bool, scaled: bool = True):
    def build(context: FusionContext, ops: list[BasicOperation], first: int):
        reason = _check_mlp(context, ops, first)
        if reason is not None:
            return reason
        features = tuple((op.in_features, op.out_features) for op in (ops[0], ops[2]))
        choice = select_backend(
            context.device, context.dtype, purpose="mlp", forced=context.settings.backend, features=features
        )
        quantized = None
        if context.settings.recipe is not None:
            quantized = select_quantized(
                context.settings.recipe, context.device, context.dtype, grouped=True,
                forced_backend=context.settings.backend, engine=context.settings.recipe_backend,
                features=features,
            )  # fmt: skip
        if isinstance(ops[0], GroupedGateUpLinear):
            fused = GroupedMLP(
                ops, choice, scale_after_fc2=scale_after_fc2, scaled=scaled, quantized=quantized
            )
            notes = _gate_up_notes(context, choice, first, scaled, scale_after_fc2)
            if quantized is not None:
                notes[0] = quantized.explain()
                notes.insert(2, "fc1's input quantized once for both; fc2's input quantized once")
            fused.note = "; ".join(notes)
            return fused
        fused = GroupedMLP(ops, choice, scale_after_fc2=scale_after_fc2, quantized=quantized)
        notes = _plan_notes(context, choice, ops[1].spec, first, scale_after_fc2)
        if quantized is not None:
            fc2_input = "activation output" if scale_after_fc2 else "probability-scaled activation output"
            notes = [quantized.explain(), f"fc2's input (the {fc2_input}) quantized once"]
            if scale_after_fc2:
                notes.append("fc2's output is saved for the scales' gradient (as unfused Scale saves it)")
            if context.has_kwarg(first + 2, OUTPUT_BUFFER_KEY):
                notes.append("fc2's fp32 result is cast into the caller's output buffer")
        fused.note = "; ".join(notes)
        return fused

    return build


def _gate_up_notes(
    context: FusionContext, choice: BackendChoice, first: int, scaled: bool, scale_after_fc2: bool
) -> list[str]:
    """What the plan says about a block whose fc1 has separate gate and up weights."""
    notes = [
        choice.explain(),
        "fc1's gate and up weights are read separately: two fc1 GEMMs, never concatenated",
        ("the activation and scaling run" if scaled and not scale_after_fc2 else "the activation runs")
        + " as one separate pass (the fused activation kernels read one fc1 weight)",
    ]
    if not scaled:
        notes.append("no routing weights in the block (the caller applies them)")
    if context.has_kwarg(first + 2, OUTPUT_BUFFER_KEY):
        notes.append(
            "fc2 writes the caller's output buffer"
            + (
                ""
                if choice.backend.writes_in_place
                else f" (copied: {choice.backend.name} cannot write in place)"
            )
        )
    return notes


def _plan_notes(
    context: FusionContext, choice: BackendChoice, spec: ActivationSpec, first: int, scale_after_fc2: bool
) -> list[str]:
    """What the plan should say about how the fused op will run."""
    backend = choice.backend
    notes = [choice.explain()]
    why_not_fused = backend.fused_activation_reason(spec, context.device)
    if why_not_fused is None:
        notes.append("activation" + ("" if scale_after_fc2 else " and scaling") + " fused with the GEMMs")
    else:
        notes.append(f"activation and scaling run as separate passes ({why_not_fused})")
    if scale_after_fc2:
        notes.append("the routing scale after fc2 is one extra in-place pass over the output")
    has_output = context.has_kwarg(first + 2, OUTPUT_BUFFER_KEY)
    # copies and composed steps the backend itself reports
    notes.extend(backend.plan_notes(context.device, None, has_output))
    if has_output and not backend.writes_in_place:
        notes.append(f"fc2 output is copied into the caller's buffer ({backend.name} cannot write in place)")
    elif has_output:
        notes.append("fc2 writes the caller's output buffer in place")
    return notes


grouped_mlp_rule = window_rule(
    "grouped_mlp", (GroupedLinear, ScaledActivation, GroupedLinear), _build(scale_after_fc2=False)
)
grouped_mlp_scale_after_rule = window_rule(
    "grouped_mlp_scale_after_fc2",
    (GroupedLinear, Activation, GroupedLinear, Scale),
    _build(scale_after_fc2=True),
)


def _look_alike_reason(middle: BasicOperation, followed_by_scale: bool) -> str | None:
    """Why ``GroupedLinear -> middle -> GroupedLinear [-> Scale]`` is no GroupedMLP pattern
    (None: it is one, and the pattern's own rule decided)."""
    scaled = ", ".join(f"Scaled{name}" for name in ("SwiGLU", "GEGLU", "ClampedSwiGLU", "SReLU"))
    if isinstance(middle, ScaledActivation) or (followed_by_scale and isinstance(middle, Activation)):
        return None  # a GroupedMLP pattern: its own rule fired or said why not
    kind = getattr(getattr(middle, "spec", None), "kind", None)
    if isinstance(middle, Activation) and kind in SUPPORTED_ACTIVATIONS:
        if followed_by_scale:
            return None
        return (
            f"{middle.op_name()} has no routing scale: use {scaled} between the grouped linears, "
            "or add Scale after fc2"
        )
    return (
        f"{middle.op_name()} is not an expert-block activation: GroupedMLP fuses {scaled} between "
        "the grouped linears (or their unscaled versions followed by Scale after fc2)"
    )


def grouped_mlp_look_alike_rule(entries: list, context: FusionContext) -> list:
    """Declines, with the reason, every ``GroupedLinear -> op -> GroupedLinear`` window that
    no GroupedMLP pattern matches (e.g. a ReLU, or SwiGLU without a routing scale), so the
    plan explains why an expert-block look-alike was not fused. Never fuses anything."""
    ops = [entry.op for entry in entries]
    for position in range(len(ops) - 2):
        fc1, middle, fc2 = ops[position : position + 3]
        if not (
            type(fc1) is GroupedLinear and type(fc2) is GroupedLinear and isinstance(middle, BasicOperation)
        ):
            continue
        followed_by_scale = position + 3 < len(ops) and isinstance(ops[position + 3], Scale)
        reason = _look_alike_reason(middle, followed_by_scale)
        if reason is not None:
            indices = [i for entry in entries[position : position + 3] for i in entry.indices]
            context.record("grouped_mlp", indices, fired=False, reason=reason)
    return entries


grouped_mlp_gate_up_unscaled_rule = window_rule(
    "grouped_mlp_gate_up_unscaled",
    (GroupedGateUpLinear, Activation, GroupedLinear),
    _build(scale_after_fc2=False, scaled=False),
)

register_fusion(grouped_mlp_rule, kind="joint")
register_fusion(grouped_mlp_scale_after_rule, kind="joint")
register_fusion(grouped_mlp_gate_up_unscaled_rule, kind="joint")
register_fusion(grouped_mlp_look_alike_rule, kind="joint")
