"""The fuser's autograd Function: one call's forward, what it saves, and its backward.

:class:`FuserFunction` receives only static state (:class:`CallState`) and tensors, so
Dynamo and AOTAutograd can trace it; backward builds fresh op contexts from what forward
saved and never mutates anything forward created. The one thing an eager call updates is
its signature's record of which backend checks have passed
(:class:`~fusible_ops.kernels.signature_checks.SignatureChecks`).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.buffers import GRAD_BUFFER_WRITES, GRAD_INPUT_BUFFER_KEY, tensors_overlap
from ..core.contract import check_backward_result, check_forward_result
from ..core.op import NO_ENTRIES, BasicOperation, OperationContext
from ..kernels.signature_checks import SignatureChecks, run_with_arguments_checked
from .plan import FusionPlan


@dataclass
class CallState:
    """Non-tensor state handed to the autograd Function for one call (never mutated in it,
    but for ``signature_checks``, a per-signature record)."""

    #: the fuser's ops (not the fuser: it keeps this state per call signature)
    ops: list[BasicOperation]
    #: each op's label in messages, ``"op 2 (GroupedLinear)"``
    labels: list[str]
    plan: FusionPlan
    kwargs: list[dict[str, Any]]
    extra_counts: list[int]
    #: per op, the names of its parameter attributes (None values dropped) in forward's order
    param_names: list[tuple[str, ...]]
    #: per op, the parameter names whose value is None (passed to ops as None)
    absent_params: list[tuple[str, ...]]
    #: per op, whether each parameter needs a gradient in this call
    param_requires_grad: list[dict[str, bool]]
    ctx_flags: list[tuple[bool, bool, bool]]
    #: for each extra input and parameter (flattened, in that order), its position among
    #: the Function's distinct arguments: a tensor given twice (the same split sizes to
    #: fc1 and fc2, tied weights) is passed once, as Dynamo requires
    slots: list[int]
    num_args: int
    #: ``(op index, buffer)`` of each grad_input buffer (empty while tracing)
    grad_buffers: list[tuple[int, torch.Tensor]]
    #: when forward ran (see :class:`~fusible_ops.core.buffers.GradBufferWrites`)
    forward_time: int
    #: whether this signature's backend calls passed their argument checks once (None while tracing)
    signature_checks: SignatureChecks | None = None
    #: derived once: each op's slice of the flattened extra inputs and of the parameters
    extra_slices: list[slice] = field(init=False)
    param_counts: list[int] = field(init=False)
    param_slices: list[slice] = field(init=False)
    num_extra: int = field(init=False)
    num_params: int = field(init=False)
    #: each op's slice of the flattened extra outputs
    output_slices: list[slice] = field(init=False)
    #: per op, the positions of its extra inputs among the Function's distinct arguments
    extra_arg_slots: list[tuple[int, ...]] = field(init=False)
    #: positions of the parameters (flattened, None dropped) among the distinct arguments
    param_arg_slots: tuple[int, ...] = field(init=False)
    #: per op, ``(name, position in the flattened parameters or None when absent)``, in the
    #: order ops see them: the parameters given, then the absent ones
    param_layout: list[tuple[tuple[str, int | None], ...]] = field(init=False)
    #: ``(op index, name, position in the flattened parameters)`` of each parameter that
    #: needs no gradient in this call: backward refuses it if it was unfrozen since
    frozen_params: tuple[tuple[int, str, int], ...] = field(init=False)
    #: per op, ``(position among its parameter gradients, name)`` of each parameter that
    #: needs a gradient in this call: backward refuses a result without it
    needed_grads: list[tuple[tuple[int, str], ...]] = field(init=False)

    def __post_init__(self) -> None:
        self.extra_slices = count_slices(self.extra_counts)
        self.param_counts = [len(names) for names in self.param_names]
        self.param_slices = count_slices(self.param_counts)
        self.num_extra = sum(self.extra_counts)
        self.num_params = sum(self.param_counts)
        self.output_slices = count_slices([op.num_extra_outputs for op in self.ops])
        extra_slots = self.slots[: self.num_extra]
        self.extra_arg_slots = [tuple(extra_slots[part]) for part in self.extra_slices]
        self.param_arg_slots = tuple(self.slots[self.num_extra :])
        layout, frozen, needed = [], [], []
        for index, (names, absent, part) in enumerate(
            zip(self.param_names, self.absent_params, self.param_slices)
        ):
            positions = range(part.start, part.stop)
            layout.append((*zip(names, positions), *((name, None) for name in absent)))
            flags = self.param_requires_grad[index]
            frozen.extend((index, name, pos) for name, pos in zip(names, positions) if not flags.get(name))
            needed.append(tuple((k, name) for k, name in enumerate(names) if flags.get(name)))
        self.param_layout = layout
        self.frozen_params = tuple(frozen)
        self.needed_grads = needed


def count_slices(counts: list[int]) -> list[slice]:
    """Each op's slice of a flat list where op ``i`` has ``counts[i]`` entries."""
    result, start = [], 0
    for count in counts:
        result.append(slice(start, start + count))
        start += count
    return result


def dedupe_args(values: list[Any]) -> tuple[list[Any], list[int]]:
    """Distinct arguments (tensors compared by identity) and each value's slot among them."""
    unique: list[Any] = []
    slots = []
    seen: dict[int, int] = {}  # id of a tensor -> its slot (every value is alive for the call)
    for value in values:
        slot = len(unique)
        if isinstance(value, torch.Tensor):
            slot = seen.setdefault(id(value), slot)
        if slot == len(unique):
            unique.append(value)
        slots.append(slot)
    return unique, slots


def _owned(output: torch.Tensor, input_: torch.Tensor) -> torch.Tensor:
    """A view of a buffer or scratch tensor is returned as a plain (detached) alias.

    Autograd treats a Function output that is a view as non-modifiable in place;
    aliases of caller buffers and fresh tensors are ours to hand out, so the caller
    may modify them (``out.add_(residual)``) like any op's output. Views of the input
    keep autograd's view tracking. Under a tracer, views are left to AOTAutograd.
    """
    if torch.compiler.is_compiling():
        return output
    if (
        isinstance(output, torch.Tensor)
        and output._is_view()
        and not (
            input_.numel() and output.untyped_storage().data_ptr() == input_.untyped_storage().data_ptr()
        )
    ):
        return output.detach()
    return output


def _split_params(state: CallState, flat: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
    """Each op's parameter dict from the flattened parameters (absent ones as None)."""
    return [
        {name: None if pos is None else flat[pos] for name, pos in layout} if layout else {}
        for layout in state.param_layout
    ]


def _check_unfrozen(state: CallState, flat_params: Sequence[torch.Tensor]) -> None:
    """Refuse a backward whose parameter was unfrozen after forward (before any write).

    Forward saved nothing that parameter's gradient needs, so the gradient cannot be
    computed; silently leaving it unset would train the wrong thing.
    """
    for index, name, pos in state.frozen_params:
        if flat_params[pos].requires_grad:
            raise unfrozen_error(state.ops[index], name)


def unfrozen_error(op: Any, name: str) -> RuntimeError:
    """The refusal of a backward whose parameter ``name`` of ``op`` was unfrozen after forward."""
    return RuntimeError(
        f"{op.op_name()}: parameter {name!r} was set to require grad after forward; its gradient "
        "cannot be computed from what forward saved. Set requires_grad before the forward pass "
        "(or run forward again)"
    )


def _check_grad_buffers(state: CallState) -> None:
    """Refuse to write a grad_input buffer that another call's backward wrote since this
    call's forward (before any write): that write is a gradient already handed out."""
    for index, buffer in state.grad_buffers:
        if GRAD_BUFFER_WRITES.written_by_other_since(buffer, state.forward_time, id(state)):
            raise RuntimeError(
                f"{state.labels[index]}: its grad_input buffer was written by another call's backward "
                "after this call's forward; writing this gradient there would overwrite that one. Give "
                "each op of a step its own grad_input buffer, or run each backward before the next "
                "forward that uses the buffer"
            )


def _record_grad_buffer_writes(state: CallState, ctxs: list[OperationContext]) -> None:
    for index, _ in state.grad_buffers:
        ctx = ctxs[index]
        if ctx.input_requires_grad and ctx.grad_input_buffer is not None:
            GRAD_BUFFER_WRITES.record(ctx.grad_input_buffer, id(state))


def _adopted_as_grad(input_: torch.Tensor | None, buffer: torch.Tensor | None) -> bool:
    """Whether an earlier backward left (a view of) ``buffer`` as the ``.grad`` of the input.

    Autograd keeps a leaf's first gradient without copying it, so after one backward with
    a grad_input buffer, ``x.grad`` *is* the buffer; writing the next gradient there and
    then accumulating would double it.
    """
    if input_ is None or buffer is None:
        return False
    for owner in (input_, input_._base):
        if owner is None or not (owner.is_leaf or owner.retains_grad):
            continue
        if owner.grad is not None and tensors_overlap(owner.grad, buffer):
            return True
    return False


def run_forward(
    plan: FusionPlan,
    ops: list[BasicOperation],
    ctxs: list[OperationContext],
    input_: torch.Tensor,
    extra_inputs: list,
    kwargs: list,
    check_results: bool = True,
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]], dict[int, tuple[int, ...]]]:
    """Run the plan's forward entries; returns the output, each basic op's extra outputs
    and the main input shape of each basic op that starts an entry. ``check_results``:
    check each entry's result against the fuser contract (:mod:`.op_contract`)."""
    x = input_
    extra_outputs: list[tuple[torch.Tensor, ...]] = [()] * len(ctxs)
    input_shapes: dict[int, tuple[int, ...]] = {}
    for entry in plan.forward:
        idx = entry.indices
        input_shapes[idx[0]] = tuple(x.shape)
        if isinstance(entry.op, BasicOperation):
            ctxs[idx[0]].backend_choice = entry.backend  # what the plan shows is what runs
        result = entry.op.fuser_forward(
            [ctxs[i] for i in idx],
            x,
            basic_op_extra_inputs=[extra_inputs[i] for i in idx],
            basic_op_kwargs=[kwargs[i] for i in idx],
        )
        if check_results:
            check_forward_result(entry.op, result, [ops[i].num_extra_outputs for i in idx])
        x, op_extra_outputs = result
        for i, outs in zip(idx, op_extra_outputs):
            extra_outputs[i] = tuple(outs)
    return x, extra_outputs, input_shapes


def run_checked_forward(checks: SignatureChecks | None, *args: Any):
    """:func:`run_forward`, skipping the backends' argument checks and the result checks when
    this call signature's forward passed them once (see :mod:`~fusible_ops.kernels.signature_checks`:
    the library's own ops return results of the same structure and shapes for the same signature)."""
    if checks is not None and checks.forward:
        return run_with_arguments_checked(run_forward, *args, check_results=False)
    result = run_forward(*args)
    if checks is not None and checks.takes_part:
        checks.forward = True  # this call ran every check and got through
    return result


def run_without_grad(
    plan: FusionPlan,
    ops: list[BasicOperation],
    input_: torch.Tensor,
    extra_inputs: list[tuple],
    kwargs: list[dict],
    param_dicts: list[dict[str, torch.Tensor | None]],
    checks: SignatureChecks | None = None,
):
    """A call in which nothing needs a gradient: the plan runs directly, no autograd Function."""
    ctxs = []
    for params in param_dicts:
        ctx = OperationContext()
        ctx.params = params
        ctxs.append(ctx)
    if torch.is_grad_enabled():  # inputs that need no gradient
        with torch.no_grad():
            x, extra_outputs, _ = run_checked_forward(checks, plan, ops, ctxs, input_, extra_inputs, kwargs)
    else:  # under no_grad already: no second context
        x, extra_outputs, _ = run_checked_forward(checks, plan, ops, ctxs, input_, extra_inputs, kwargs)
    flat_extra_outputs = [t for outs in extra_outputs for t in outs]
    return (x, *flat_extra_outputs) if flat_extra_outputs else x


class FuserFunction(torch.autograd.Function):
    @staticmethod
    def forward(func_ctx, input_: torch.Tensor, state: CallState, *unique_args: Any):
        extra_inputs = [tuple([unique_args[slot] for slot in slots]) for slots in state.extra_arg_slots]
        flat_params = [unique_args[slot] for slot in state.param_arg_slots]
        params = _split_params(state, flat_params)

        ctxs = []
        for index, (requires_grad, input_requires_grad, params_require_grad) in enumerate(state.ctx_flags):
            ctx = OperationContext()
            if requires_grad:
                ctx.requires_grad = True
                ctx.input_requires_grad = input_requires_grad
                ctx.params_require_grad = params_require_grad
                ctx.param_requires_grad = state.param_requires_grad[index]
            ctx.params = params[index]
            op_kwargs = state.kwargs[index]
            if op_kwargs:
                ctx.grad_input_buffer = op_kwargs.get(GRAD_INPUT_BUFFER_KEY)
            ctxs.append(ctx)

        x, extra_outputs, input_shapes = run_checked_forward(
            state.signature_checks, state.plan, state.ops, ctxs, input_, extra_inputs, state.kwargs
        )

        if state.plan.requires_grad:
            # The parameters are saved like any input autograd keeps: backward computes
            # with this call's values, and autograd's version check catches in-place changes.
            to_save: list[torch.Tensor | None] = list(flat_params)
            layout = []
            for ctx in ctxs:
                named = ctx.to_save_named
                to_save.extend(ctx.to_save)
                # the shared empty default is a mappingproxy, which Dynamo cannot read once
                # the traced code has mutated any dict
                names = () if named is NO_ENTRIES else tuple(named)
                to_save.extend(named[name] for name in names)
                layout.append((len(ctx.to_save), names))
                ctx.to_save, ctx.to_save_named, ctx.params = (), {}, {}
            func_ctx.save_for_backward(*to_save)
            func_ctx.layout = layout
            func_ctx.ctxs = ctxs
            func_ctx.state = state
            # backward entries may group ops differently: a shape only where both agree
            func_ctx.input_shapes = None if torch.compiler.is_compiling() else input_shapes
            if state.grad_buffers and state.grad_buffers[0][0] == 0:
                # a weak reference: backward only asks whether its .grad is the buffer
                func_ctx.input_ref = weakref.ref(input_)

        flat_extra_outputs = [_owned(t, input_) for outs in extra_outputs for t in outs]
        if flat_extra_outputs:
            return (_owned(x, input_), *flat_extra_outputs)
        return _owned(x, input_)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(func_ctx, grad_output: torch.Tensor, *grad_extra_outputs_flat: torch.Tensor):
        state: CallState = func_ctx.state
        saved = func_ctx.saved_tensors
        num_params = state.num_params
        params = _split_params(state, saved)
        if not torch.compiler.is_compiling():
            if state.frozen_params:
                _check_unfrozen(state, saved)
            if state.grad_buffers:
                _check_grad_buffers(state)
        position = num_params
        ctxs = []
        for index, (fwd_ctx, (num_positional, names)) in enumerate(zip(func_ctx.ctxs, func_ctx.layout)):
            positional = tuple(saved[position : position + num_positional])
            position += num_positional
            named = {name: saved[position + k] for k, name in enumerate(names)}
            position += len(names)
            ctxs.append(fwd_ctx.for_backward(positional, named, params[index]))
        input_ref = getattr(func_ctx, "input_ref", None)
        if input_ref is not None and _adopted_as_grad(input_ref(), ctxs[0].grad_input_buffer):
            # x.grad is the buffer: the gradient goes to fresh memory and autograd adds it
            # to x.grad (the buffer), so the buffer ends up holding the accumulated gradient
            ctxs[0].grad_input_buffer = None

        grad_extra_outputs = [tuple(grad_extra_outputs_flat[part]) for part in state.output_slices]
        checks = state.signature_checks
        if checks is not None and checks.backward:
            grad, grad_params, grad_extra_inputs = run_with_arguments_checked(
                _run_backward, func_ctx, ctxs, params, grad_output, grad_extra_outputs, check_results=False
            )
        else:
            grad, grad_params, grad_extra_inputs = _run_backward(
                func_ctx, ctxs, params, grad_output, grad_extra_outputs
            )
            if checks is not None and checks.takes_part:
                checks.backward = True  # this backward ran every check and got through
        if state.grad_buffers:
            _record_grad_buffer_writes(state, ctxs)
        flat_grads = [g for grads in grad_extra_inputs for g in grads]
        flat_grads.extend(g for grads in grad_params for g in grads)
        unique_grads: list[torch.Tensor | None] = [None] * state.num_args
        for slot, g in zip(state.slots, flat_grads):
            if g is not None:
                known = unique_grads[slot]
                unique_grads[slot] = g if known is None else known + g
        return (grad, None, *unique_grads)


def _run_backward(
    func_ctx,
    ctxs: list[OperationContext],
    params,
    grad_output,
    grad_extra_outputs,
    check_results: bool = True,
):
    """The plan's backward entries, last first: ``(grad input, param grads, extra-input grads)``;
    ``check_results`` as for :func:`run_forward`."""
    state: CallState = func_ctx.state
    param_counts = state.param_counts
    grad_params: list[list[torch.Tensor | None]] = [[None] * n for n in param_counts]
    grad_extra_inputs: list[tuple] = [(None,) * n for n in state.extra_counts]
    grad = grad_output
    for entry in reversed(state.plan.backward):
        idx = entry.indices
        if not any(ctxs[i].requires_grad for i in idx):
            # grad requirements only switch on along the chain: nothing before needs grad
            grad = None
            break
        result = entry.op.fuser_backward(
            [ctxs[i] for i in idx],
            grad,
            basic_op_grad_extra_outputs=[grad_extra_outputs[i] for i in idx],
        )
        if check_results:
            shapes = func_ctx.input_shapes
            check_backward_result(
                entry.op,
                result,
                None if shapes is None else shapes.get(idx[0]),
                [[t for t in params[i].values() if t is not None] for i in idx],
                [state.extra_counts[i] for i in idx],
            )
            _check_needed_grads(state, entry.op, idx, result[1])
        grad, op_grad_params, op_grad_extra = result
        for i, g_params, g_extra in zip(idx, op_grad_params, op_grad_extra):
            grad_params[i] = list(g_params) if g_params else [None] * param_counts[i]
            grad_extra_inputs[i] = tuple(g_extra) if g_extra else (None,) * state.extra_counts[i]
    return grad, grad_params, grad_extra_inputs


def _check_needed_grads(state: CallState, op: Any, idx: Sequence[int], grad_params: Sequence[Any]) -> None:
    """Refuse a backward result without a gradient for a parameter that requires grad.

    Autograd would take the missing gradient for zero and leave ``.grad`` unset: the
    parameter would silently not train. Runs after the structure check (one entry per op).
    """
    for position, index in enumerate(idx):
        needed = state.needed_grads[index]
        if not needed:
            continue
        grads = grad_params[position]
        for k, name in needed:
            if not grads or grads[k] is None:
                raise RuntimeError(
                    f"{_backward_label(op)} returned no gradient (None) for parameter {name!r} of basic op "
                    f"{position}, {state.labels[index]}, which requires grad; it must return that gradient "
                    f"whenever ctx.needs_param_grad({name!r}) is True (otherwise the parameter gets no gradient)"
                )


def _backward_label(op: Any) -> str:
    """``"LinearReLU.fuser_backward"``, or ``"MyOp.op_backward"`` for a basic op that implements that."""
    if isinstance(op, BasicOperation) and type(op).fuser_backward is BasicOperation.fuser_backward:
        return f"{op.op_name()}.op_backward"
    return f"{type(op).__name__}.fuser_backward"
