"""OperationFuser: runs a list of basic ops as one autograd Function, fused per a plan."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from .buffers import (
    GRAD_BUFFER_WRITES,
    GRAD_INPUT_BUFFER_KEY,
    call_buffers,
    check_call_buffers,
    tensors_overlap,
)
from .dtypes import compute_dtype
from .fusion_rules import FusionContext, registered_rules, registry_version
from .op import BasicOperation, OperationContext, TensorMeta
from .op_contract import check_backward_result, check_forward_result
from .plan import FusionDecision, FusionPlan, PlanEntry
from .settings import current_settings
from .splits import start_call

_MAX_CACHED_PLANS = 32


def _is_dtensor(tensor: Any) -> bool:
    return type(tensor).__name__ == "DTensor"


_CHEAP_COMPARE_NUMEL = 4096


def _extra_input_identity(value: Any, by_value: bool) -> tuple[tuple, str]:
    """A key under which equal extra inputs collide when equality is cheap to see.

    Integer lists and small integer CPU tensors compare by value; anything else (a
    device tensor, whose values would need a host sync) only by identity. While
    tracing (``by_value=False``) tensors compare by identity only: reading their
    values would be a host read in the graph.
    """
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return ("values", tuple(value)), "list"
    if isinstance(value, torch.Tensor):
        kind = f"{value.device.type} tensor"
        if (
            by_value
            and value.device.type == "cpu"
            and not value.is_floating_point()
            and value.dim() == 1
            and value.numel() <= _CHEAP_COMPARE_NUMEL
        ):
            return ("values", tuple(value.tolist())), kind
        return ("object", value), kind
    return ("object", value), type(value).__name__


def _classify_extra_inputs(
    extra_inputs: list[tuple[Any, ...]],
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[str, ...], ...]]:
    by_value = not torch.compiler.is_compiling()
    seen: list[tuple] = []
    classes, kinds = [], []
    for op_inputs in extra_inputs:
        op_classes, op_kinds = [], []
        for value in op_inputs:
            identity, kind = _extra_input_identity(value, by_value)
            op_classes.append(_class_of(seen, identity))
            op_kinds.append(kind)
        classes.append(tuple(op_classes))
        kinds.append(tuple(op_kinds))
    return tuple(classes), tuple(kinds)


def _class_of(seen: list[tuple], identity: tuple) -> int:
    """Index of ``identity`` among those ``seen`` (appended when new)."""
    for index, known in enumerate(seen):
        if _same_identity(known, identity):
            return index
    seen.append(identity)
    return len(seen) - 1


def _same_identity(a: tuple, b: tuple) -> bool:
    if a[0] != b[0]:
        return False
    return a[1] is b[1] if a[0] == "object" else a[1] == b[1]


def _checked(rule, entries, ops: list[BasicOperation], kind: str) -> list[PlanEntry]:
    """``entries`` if they cover every basic op exactly once, in order, each with its own ops.

    A rule that drops, repeats or reorders an op, or builds a fused op over other ops than
    the indices it claims, would silently change the math: refused, naming the rule.
    """
    name = getattr(rule, "__name__", repr(rule))
    where = f"fusion rule {name!r} ({kind})"
    if not isinstance(entries, (list, tuple)) or not all(isinstance(e, PlanEntry) for e in entries):
        raise TypeError(f"{where} must return a list of PlanEntry, got {type(entries).__name__}")
    covered = [i for entry in entries for i in entry.indices]
    if covered != list(range(len(ops))):
        raise RuntimeError(
            f"{where} returned a plan covering ops {covered}; every op 0..{len(ops) - 1} must appear "
            "exactly once and in order"
        )
    for entry in entries:
        expected = [ops[i] for i in entry.indices]
        got = [entry.op] if isinstance(entry.op, BasicOperation) else list(getattr(entry.op, "basic_ops", ()))
        if len(got) != len(expected) or any(a is not b for a, b in zip(got, expected)):
            raise RuntimeError(
                f"{where}: the entry for ops {list(entry.indices)} holds "
                f"{[op.op_name() for op in got] or type(entry.op).__name__}, not those ops "
                f"({[op.op_name() for op in expected]})"
            )
    return list(entries)


def _shifted(entry: PlanEntry, offset: int) -> PlanEntry:
    return PlanEntry(entry.op, tuple(i + offset for i in entry.indices), entry.backend)


def _autocast_state(device: torch.device) -> tuple:
    if torch.is_autocast_enabled(device.type):
        return (True, torch.get_autocast_dtype(device.type))
    return (False, None)


@dataclass
class _CallState:
    """Non-tensor state handed to the autograd Function for one call (never mutated in it)."""

    fuser: OperationFuser
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
    #: when forward ran (see :class:`~fusible_ops.buffers.GradBufferWrites`)
    forward_time: int


def _dedupe(values: list[Any]) -> tuple[list[Any], list[int]]:
    """Distinct arguments (tensors compared by identity) and each value's slot among them."""
    unique: list[Any] = []
    slots = []
    for value in values:
        if isinstance(value, torch.Tensor):
            for j, known in enumerate(unique):
                if known is value:
                    slots.append(j)
                    break
            else:
                slots.append(len(unique))
                unique.append(value)
        else:
            slots.append(len(unique))
            unique.append(value)
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


def _op_params(state: _CallState, index: int, tensors: Sequence[torch.Tensor]) -> dict[str, Any]:
    params: dict[str, Any] = dict(zip(state.param_names[index], tensors))
    for name in state.absent_params[index]:
        params[name] = None
    return params


def _check_unfrozen(state: _CallState, params: list[dict[str, Any]]) -> None:
    """Refuse a backward whose parameter was unfrozen after forward (before any write).

    Forward saved nothing that parameter's gradient needs, so the gradient cannot be
    computed; silently leaving it unset would train the wrong thing.
    """
    for op, op_params, flags in zip(state.fuser.ops, params, state.param_requires_grad):
        for name, tensor in op_params.items():
            if tensor is not None and tensor.requires_grad and not flags.get(name, False):
                raise RuntimeError(
                    f"{op.op_name()}: parameter {name!r} was set to require grad after forward; its "
                    "gradient cannot be computed from what forward saved. Set requires_grad before "
                    "the forward pass (or run forward again)"
                )


def _check_dense(op_name: str, what: str, tensor: torch.Tensor) -> None:
    """Sparse and meta tensors have no dense data for the kernels: a clear error, not a raw one."""
    if tensor.layout != torch.strided:
        raise ValueError(
            f"{op_name}: {what} has layout {tensor.layout}; only dense (strided) tensors are supported"
        )
    if tensor.is_meta:
        raise ValueError(f"{op_name}: {what} is a meta tensor (shape only, no data); the op needs real data")


def _check_grad_buffers(state: _CallState) -> None:
    """Refuse to write a grad_input buffer that another call's backward wrote since this
    call's forward (before any write): that write is a gradient already handed out."""
    for index, buffer in state.grad_buffers:
        if GRAD_BUFFER_WRITES.written_by_other_since(buffer, state.forward_time, id(state)):
            raise RuntimeError(
                f"{state.fuser.label(index)}: its grad_input buffer was written by another call's backward "
                "after this call's forward; writing this gradient there would overwrite that one. Give "
                "each op of a step its own grad_input buffer, or run each backward before the next "
                "forward that uses the buffer"
            )


def _record_grad_buffer_writes(state: _CallState, ctxs: list[OperationContext]) -> None:
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


def _split_params(state: _CallState, flat: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
    result, start = [], 0
    for index, names in enumerate(state.param_names):
        result.append(_op_params(state, index, flat[start : start + len(names)]))
        start += len(names)
    return result


def _run_forward(
    plan: FusionPlan,
    ops: list[BasicOperation],
    ctxs: list[OperationContext],
    input_: torch.Tensor,
    extra_inputs: list,
    kwargs: list,
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]], dict[int, tuple[int, ...]]]:
    """Run the plan's forward entries; returns the output, each basic op's extra outputs
    and the main input shape of each basic op that starts an entry."""
    x = input_
    extra_outputs: list[tuple[torch.Tensor, ...]] = [()] * len(ctxs)
    input_shapes: dict[int, tuple[int, ...]] = {}
    for entry in plan.forward:
        idx = entry.indices
        input_shapes[idx[0]] = tuple(x.shape)
        result = entry.op.fuser_forward(
            [ctxs[i] for i in idx],
            x,
            basic_op_extra_inputs=[extra_inputs[i] for i in idx],
            basic_op_kwargs=[kwargs[i] for i in idx],
        )
        check_forward_result(entry.op, result, [ops[i].num_extra_outputs for i in idx])
        x, op_extra_outputs = result
        for i, outs in zip(idx, op_extra_outputs):
            extra_outputs[i] = tuple(outs)
    return x, extra_outputs, input_shapes


class _FuserFunction(torch.autograd.Function):
    @staticmethod
    def forward(func_ctx, input_: torch.Tensor, state: _CallState, *unique_args: Any):
        flat_args = [unique_args[slot] for slot in state.slots]
        num_extra = sum(state.extra_counts)
        extra_flat, flat_params = flat_args[:num_extra], flat_args[num_extra:]
        extra_inputs, start = [], 0
        for count in state.extra_counts:
            extra_inputs.append(tuple(extra_flat[start : start + count]))
            start += count

        ctxs = []
        for params, (requires_grad, input_requires_grad, params_require_grad) in zip(
            _split_params(state, flat_params), state.ctx_flags
        ):
            ctx = OperationContext()
            ctx.requires_grad = requires_grad
            ctx.input_requires_grad = input_requires_grad
            ctx.params_require_grad = params_require_grad
            ctx.params = params
            ctx.param_requires_grad = state.param_requires_grad[len(ctxs)]
            ctx.grad_input_buffer = state.kwargs[len(ctxs)].get(GRAD_INPUT_BUFFER_KEY)
            ctxs.append(ctx)

        x, extra_outputs, input_shapes = _run_forward(
            state.plan, state.fuser.ops, ctxs, input_, extra_inputs, state.kwargs
        )

        if state.plan.requires_grad:
            # The parameters are saved like any input autograd keeps: backward computes
            # with this call's values, and autograd's version check catches in-place changes.
            to_save: list[torch.Tensor | None] = list(flat_params)
            layout = []
            for ctx in ctxs:
                names = tuple(ctx.to_save_named)
                to_save.extend(ctx.to_save)
                to_save.extend(ctx.to_save_named[name] for name in names)
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
        state: _CallState = func_ctx.state
        saved = func_ctx.saved_tensors
        num_params = sum(len(names) for names in state.param_names)
        params = _split_params(state, saved[:num_params])
        if not torch.compiler.is_compiling():
            _check_unfrozen(state, params)
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

        ops = state.fuser.ops
        grad_extra_outputs, start = [], 0
        for op in ops:
            grad_extra_outputs.append(tuple(grad_extra_outputs_flat[start : start + op.num_extra_outputs]))
            start += op.num_extra_outputs

        param_counts = [len(names) for names in state.param_names]
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
            shapes = func_ctx.input_shapes
            check_backward_result(
                entry.op,
                result,
                None if shapes is None else shapes.get(idx[0]),
                [[t for t in params[i].values() if t is not None] for i in idx],
                [state.extra_counts[i] for i in idx],
            )
            grad, op_grad_params, op_grad_extra = result
            for i, g_params, g_extra in zip(idx, op_grad_params, op_grad_extra):
                grad_params[i] = list(g_params) if g_params else [None] * param_counts[i]
                grad_extra_inputs[i] = tuple(g_extra) if g_extra else (None,) * state.extra_counts[i]
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


class OperationFuser:
    """Runs ``ops`` (basic ops) as one autograd Function, fused according to the plan.

    Plans are cached under everything they depend on: grad requirements, dtype,
    device, autocast, settings, which kwargs are given, which extra inputs are
    known equal, training mode and the rule registry.
    """

    def __init__(
        self, ops: Sequence[BasicOperation], *, honour_hooks: bool = True, first_index: int | None = None
    ) -> None:
        self.ops = list(ops)
        #: False for an op's own ``forward`` (its hooks already ran in ``nn.Module.__call__``)
        self.honour_hooks = honour_hooks
        #: position of ``ops[0]`` in the enclosing Sequential (None: not in one), for messages
        self.first_index = first_index
        self._plans: OrderedDict[tuple, FusionPlan] = OrderedDict()
        self._segments: dict[tuple[bool, ...], list] = {}
        self._thread_plans: threading.local | None = None
        self._traced_plan: FusionPlan | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_thread_plans"] = None
        return state

    @property
    def last_plan(self) -> FusionPlan | None:
        """The plan of this thread's most recent call (what actually ran)."""
        local = self._thread_plans
        plan = getattr(local, "plan", None) if local is not None else None
        return plan if plan is not None else self._traced_plan

    def _record_plan(self, plan: FusionPlan) -> None:
        if torch.compiler.is_compiling():
            # a traced call: thread-local storage cannot be traced
            self._traced_plan = plan
            return
        if self._thread_plans is None:
            self._thread_plans = threading.local()
        self._thread_plans.plan = plan

    def label(self, index: int) -> str:
        """``"op 2 (GroupedLinear)"``: ``ops[index]`` by its position in the Sequential."""
        return f"op {(self.first_index or 0) + index} ({self.ops[index].op_name()})"

    def _located(self, error: Exception, index: int, meta: TensorMeta) -> Exception:
        """``error`` from ``ops[index]``'s checks, with where the op sits and, for a width
        mismatch after a gated activation, what the width should have been."""
        if type(error) not in (ValueError, TypeError):
            return error
        notes = []
        if self.first_index is not None:
            notes.append(f"op {self.first_index + index} of the Sequential")
        previous = self.ops[index - 1] if index else None
        spec = getattr(previous, "spec", None)
        in_features = getattr(self.ops[index], "in_features", None)
        if (
            spec is not None
            and getattr(spec, "gated", False)
            and meta.shape
            and in_features == 2 * meta.shape[-1]
        ):
            notes.append(
                f"{self.label(index - 1)} is a gated activation and halves the width, so the op "
                f"before it must produce {2 * in_features} columns, not {in_features}"
            )
        return type(error)(f"{error} ({'; '.join(notes)})") if notes else error

    def _preflight_ops(
        self, meta: TensorMeta, extra_inputs: list[tuple], kwargs: list[dict], guard: list[torch.Tensor]
    ) -> TensorMeta:
        """Each op's checks in order; returns the output meta. Also refuses buffers that
        overlap each other (the Sequential checks the whole call, see check_call_buffers)."""
        for index, (op, op_extra, op_kwargs) in enumerate(zip(self.ops, extra_inputs, kwargs)):
            try:
                op.check_kwargs(op_kwargs)
                next_meta = op.preflight(meta, op_extra, op_kwargs, guard=guard)
            except (ValueError, TypeError) as error:
                raise self._located(error, index, meta) from None
            meta = next_meta
        positions = [(self.first_index or 0) + i for i in range(len(self.ops))]
        check_call_buffers(call_buffers(self.ops, kwargs, positions), ())
        return meta

    # ------------------------------------------------------------ planning
    def _param_dicts(self, *, for_kernels: bool = True) -> list[dict[str, torch.Tensor | None]]:
        """Each op's parameter tensors of this call; ``for_kernels`` refuses sharded DTensors."""
        dicts = [op.param_tensors() for op in self.ops]
        for op, params in zip(self.ops, dicts):
            if op.accepts_dtensor or not for_kernels:
                continue
            for name, tensor in params.items():
                if _is_dtensor(tensor):
                    raise ValueError(
                        f"{op.op_name()}: parameter {name!r} is a DTensor (sharded, e.g. by fully_shard), "
                        "which this op's kernels cannot take; apply fully_shard to the op itself (it then "
                        "runs alone and FSDP unshards it for the call) or to the enclosing Sequential"
                    )
        return dicts

    def _params(self, *, for_kernels: bool = True) -> list[list[torch.Tensor]]:
        return [[t for t in d.values() if t is not None] for d in self._param_dicts(for_kernels=for_kernels)]

    def _grad_flags(
        self, input_requires_grad: bool, extra_inputs: list[tuple], params: list[list[torch.Tensor]]
    ) -> list[tuple[bool, bool, bool]]:
        grad_enabled = torch.is_grad_enabled()
        upstream = grad_enabled and input_requires_grad
        flags = []
        for op_extra, op_params in zip(extra_inputs, params):
            params_grad = grad_enabled and any(p.requires_grad for p in op_params)
            extra_grad = grad_enabled and any(
                isinstance(t, torch.Tensor) and t.requires_grad for t in op_extra
            )
            flags.append((upstream or params_grad or extra_grad, upstream, params_grad))
            upstream = upstream or params_grad or extra_grad
        return flags

    def plan(
        self,
        input_meta: TensorMeta,
        extra_inputs: list[tuple[Any, ...]],
        kwargs: list[dict[str, Any]],
        grad_flags: list[tuple[bool, bool, bool]],
        params: list[list[torch.nn.Parameter]] | None = None,
    ) -> FusionPlan:
        settings = current_settings()
        if params is None:
            params = self._params()
        classes, kinds = _classify_extra_inputs(extra_inputs)
        kwarg_keys = tuple(
            frozenset(k for k, v in op_kwargs.items() if v is not None) for op_kwargs in kwargs
        )
        key = (
            settings,
            input_meta.dtype,
            input_meta.device,
            _autocast_state(input_meta.device),
            tuple(grad_flags),
            tuple((p.dtype, p.device, type(p)) for op_params in params for p in op_params),
            kwarg_keys,
            classes,
            kinds,
            tuple(op.training for op in self.ops),
            registry_version(),
        )
        plan = self._plans.get(key)
        if plan is None:
            context = FusionContext(
                ops=tuple(self.ops),
                dtype=compute_dtype(input_meta.dtype, input_meta.device),
                device=input_meta.device,
                requires_grad=any(flag[0] for flag in grad_flags),
                settings=settings,
                kwarg_keys=kwarg_keys,
                extra_input_classes=classes,
                extra_input_kinds=kinds,
                decisions=[],
            )
            plan = self._make_plan(context)
            self._plans[key] = plan
            if len(self._plans) > _MAX_CACHED_PLANS:
                self._plans.popitem(last=False)
        return plan

    def _make_plan(self, context: FusionContext) -> FusionPlan:
        base = []
        for i, op in enumerate(self.ops):
            describe = getattr(op, "plan_backend", None)
            base.append(PlanEntry(op, (i,), describe(context.device, context.dtype) if describe else None))
        forward = backward = base
        if context.settings.fusion:
            context.kind = "joint"
            for rule in registered_rules("joint"):
                forward = _checked(rule, rule(forward, context), self.ops, "joint")
            backward = forward
            context.kind = "forward"
            for rule in registered_rules("forward"):
                forward = _checked(rule, rule(forward, context), self.ops, "forward")
            if context.requires_grad:
                context.kind = "backward"
                for rule in registered_rules("backward"):
                    backward = _checked(rule, rule(backward, context), self.ops, "backward")
        return FusionPlan(
            op_names=[op.op_name() for op in self.ops],
            forward=list(forward),
            backward=list(backward),
            decisions=list(context.decisions),
            fusion_enabled=context.settings.fusion,
            dtype=context.dtype,
            device=context.device,
            requires_grad=context.requires_grad,
        )

    # ------------------------------------------------------------ running
    def split_extra_inputs(self, extra_inputs: Sequence[Any]) -> list[tuple[Any, ...]]:
        needed = sum(op.num_extra_inputs for op in self.ops)
        if len(extra_inputs) != needed:
            detail = ", ".join(f"{op.op_name()} takes {op.num_extra_inputs}" for op in self.ops)
            raise ValueError(f"expected {needed} extra input(s) ({detail}), got {len(extra_inputs)}")
        result, start = [], 0
        for op in self.ops:
            result.append(tuple(extra_inputs[start : start + op.num_extra_inputs]))
            start += op.num_extra_inputs
        return result

    def preflight(
        self, input_: torch.Tensor, extra_inputs: list[tuple], kwargs: list[dict], params: list[list]
    ) -> TensorMeta:
        """Validate the whole call before anything is computed or written."""
        if not isinstance(input_, torch.Tensor):
            raise TypeError(
                f"{self.ops[0].op_name()}: input must be a torch.Tensor, got {type(input_).__name__}"
            )
        _check_dense(self.ops[0].op_name(), "input", input_)
        for op, op_extra in zip(self.ops, extra_inputs):
            for value in op_extra:
                if isinstance(value, torch.Tensor):
                    _check_dense(op.op_name(), "extra input", value)
        guard = [input_]
        guard.extend(t for op_extra in extra_inputs for t in op_extra if isinstance(t, torch.Tensor))
        guard.extend(p for op_params in params for p in op_params)
        meta = TensorMeta(tuple(input_.shape), input_.dtype, input_.device)
        return self._preflight_ops(meta, extra_inputs, kwargs, guard)

    def _check_not_inference(
        self, input_: torch.Tensor, extra_inputs: list[tuple], params: list[list]
    ) -> None:
        """A call that computes gradients cannot use tensors made under ``inference_mode``
        (autograd refuses to save them, after forward has written its buffers)."""
        if torch.compiler.is_compiling() or torch.is_inference_mode_enabled():
            return
        candidates = [("input", 0, input_)]
        for index, (op_extra, op_params) in enumerate(zip(extra_inputs, params)):
            candidates.extend(("extra input", index, t) for t in op_extra if isinstance(t, torch.Tensor))
            candidates.extend(("parameter", index, t) for t in op_params)
        for what, index, tensor in candidates:
            if tensor.is_inference():
                raise ValueError(
                    f"{self.label(index)}: {what} (shape {tuple(tensor.shape)}) was created under "
                    "torch.inference_mode and cannot be used in a call that computes gradients; "
                    "clone it outside inference mode, or run the call under torch.no_grad()"
                )

    def explain(
        self,
        input_meta: TensorMeta,
        input_requires_grad: bool,
        extra_inputs: Sequence[Any],
        basic_op_kwargs: Sequence[dict[str, Any] | None] | None = None,
        guard: Sequence[torch.Tensor] = (),
    ) -> tuple[FusionPlan, TensorMeta]:
        """The plan a call would use, and the output meta, without computing anything."""
        per_op_extra = self.split_extra_inputs(extra_inputs)
        kwargs = [dict(k) if k else {} for k in (basic_op_kwargs or [None] * len(self.ops))]
        hooked = [op.hook_reason() for op in self.ops] if self.honour_hooks else []
        if any(hooked):
            return self._explain_segmented(
                input_meta, input_requires_grad, per_op_extra, kwargs, guard, hooked
            )
        # parameters may be sharded DTensors here (FSDP reshards between calls): only
        # their dtype, device and type matter for the plan
        params = self._params(for_kernels=False)
        meta = self._preflight_ops(input_meta, per_op_extra, kwargs, list(guard))
        grad_flags = self._grad_flags(input_requires_grad, per_op_extra, params)
        return self.plan(input_meta, per_op_extra, kwargs, grad_flags, params), meta

    def _explain_segmented(self, meta, input_requires_grad, extra_inputs, kwargs, guard, hooked):
        segments = self._segments_for(hooked)
        plans = []
        for indices, fuser in segments:
            sub = fuser or OperationFuser(
                [self.ops[indices[0]]], honour_hooks=False, first_index=self._index_of(indices[0])
            )
            flat_extra = [t for i in indices for t in extra_inputs[i]]
            plan, meta = sub.explain(
                meta, input_requires_grad, flat_extra, [kwargs[i] for i in indices], guard
            )
            input_requires_grad = input_requires_grad or plan.requires_grad
            plans.append(plan)
        return self._segmented_plan(segments, hooked, plans, meta.device, meta.dtype), meta

    def __call__(
        self,
        input_: torch.Tensor,
        *extra_inputs: Any,
        basic_op_kwargs: Sequence[dict[str, Any] | None] | None = None,
    ):
        start_call()
        per_op_extra = self.split_extra_inputs(extra_inputs)
        if basic_op_kwargs is None:
            kwargs = [{} for _ in self.ops]
        else:
            kwargs = [dict(k) if k else {} for k in basic_op_kwargs]
        hooked = [op.hook_reason() for op in self.ops] if self.honour_hooks else []
        if any(hooked):
            return self._call_segmented(input_, per_op_extra, kwargs, hooked)
        param_dicts = self._param_dicts()
        params = [[t for t in d.values() if t is not None] for d in param_dicts]
        self.preflight(input_, per_op_extra, kwargs, params)
        grad_flags = self._grad_flags(input_.requires_grad, per_op_extra, params)
        meta = TensorMeta(tuple(input_.shape), input_.dtype, input_.device)
        plan = self.plan(meta, per_op_extra, kwargs, grad_flags, params)
        self._record_plan(plan)
        flat_extra = [t for op_extra in per_op_extra for t in op_extra]
        flat_params = [p for op_params in params for p in op_params]
        if not any(flag[0] for flag in grad_flags):
            # nothing needs a gradient: no autograd Function, the plan runs directly
            return self._run_inference(plan, input_, per_op_extra, kwargs, param_dicts)
        self._check_not_inference(input_, per_op_extra, params)
        unique_args, slots = _dedupe(flat_extra + flat_params)
        state = _CallState(
            fuser=self,
            plan=plan,
            kwargs=kwargs,
            extra_counts=[op.num_extra_inputs for op in self.ops],
            param_names=[tuple(n for n, t in d.items() if t is not None) for d in param_dicts],
            absent_params=[tuple(n for n, t in d.items() if t is None) for d in param_dicts],
            param_requires_grad=[
                {n: t is not None and t.requires_grad for n, t in d.items()} for d in param_dicts
            ],
            ctx_flags=grad_flags,
            slots=slots,
            num_args=len(unique_args),
            grad_buffers=[]
            if torch.compiler.is_compiling()
            else [
                (i, k[GRAD_INPUT_BUFFER_KEY])
                for i, k in enumerate(kwargs)
                if isinstance(k.get(GRAD_INPUT_BUFFER_KEY), torch.Tensor)
            ],
            forward_time=0 if torch.compiler.is_compiling() else GRAD_BUFFER_WRITES.now(),
        )
        return _FuserFunction.apply(input_, state, *unique_args)

    def _run_inference(
        self,
        plan: FusionPlan,
        input_: torch.Tensor,
        extra_inputs: list[tuple],
        kwargs: list[dict],
        param_dicts: list[dict[str, torch.Tensor | None]],
    ):
        ctxs = []
        for params in param_dicts:
            ctx = OperationContext()
            ctx.params = params
            ctxs.append(ctx)
        with torch.no_grad():
            x, extra_outputs, _ = _run_forward(plan, self.ops, ctxs, input_, extra_inputs, kwargs)
        flat_extra_outputs = [t for outs in extra_outputs for t in outs]
        return (x, *flat_extra_outputs) if flat_extra_outputs else x

    # ------------------------------------------------------------ ops with hooks
    def _call_segmented(
        self, input_: torch.Tensor, extra_inputs: list[tuple], kwargs: list[dict], hooked: list[str | None]
    ):
        """Ops with module hooks run alone through ``nn.Module.__call__`` so the hooks fire
        with the tensors the op sees; the runs between them are fused as usual."""
        segments = self._segments_for(hooked)
        x = input_
        extra_outputs: list[torch.Tensor] = []
        for indices, fuser in segments:
            if fuser is None:
                i = indices[0]
                result = self.ops[i](x, *extra_inputs[i], **kwargs[i])
            else:
                result = fuser(
                    x,
                    *[t for i in indices for t in extra_inputs[i]],
                    basic_op_kwargs=[kwargs[i] for i in indices],
                )
            if isinstance(result, tuple):
                x, *outs = result
                extra_outputs.extend(outs)
            else:
                x = result
        plans = [None if fuser is None else fuser.last_plan for _, fuser in segments]
        dtype = compute_dtype(input_.dtype, input_.device)
        self._record_plan(self._segmented_plan(segments, hooked, plans, input_.device, dtype))
        return (x, *extra_outputs) if extra_outputs else x

    def _segments_for(self, hooked: list[str | None]) -> list[tuple[list[int], OperationFuser | None]]:
        """Runs of ops without hooks (a fuser each) and hooked ops (None: called alone), cached."""
        key = tuple(bool(h) for h in hooked)
        segments = self._segments.get(key)
        if segments is None:
            segments, run = [], []
            for i, reason in enumerate(hooked):
                if reason is None:
                    run.append(i)
                    continue
                if run:
                    segments.append((run, self._sub_fuser(run)))
                    run = []
                segments.append(([i], None))
            if run:
                segments.append((run, self._sub_fuser(run)))
            self._segments[key] = segments
        return segments

    def _index_of(self, index: int) -> int | None:
        return None if self.first_index is None else self.first_index + index

    def _sub_fuser(self, indices: list[int]) -> OperationFuser:
        return OperationFuser([self.ops[j] for j in indices], first_index=self._index_of(indices[0]))

    def _segmented_plan(
        self,
        segments: list,
        hooked: list[str | None],
        plans: list[FusionPlan | None],
        device: torch.device,
        dtype: torch.dtype,
    ) -> FusionPlan:
        forward, backward, decisions = [], [], []
        template = None
        for (indices, fuser), plan in zip(segments, plans):
            first = indices[0]
            if fuser is None:
                op = self.ops[first]
                describe = getattr(op, "plan_backend", None)
                entry = PlanEntry(op, (first,), describe(device, dtype) if describe else None)
                forward.append(entry)
                backward.append(entry)
                decisions.append(
                    FusionDecision(
                        "module_hooks",
                        "joint",
                        (first,),
                        False,
                        reason=f"{hooked[first]} on op {first} ({op.op_name()}): it runs alone, unfused, "
                        "through nn.Module.__call__",
                    )
                )
                continue
            template = plan
            forward.extend(_shifted(e, first) for e in plan.forward)
            backward.extend(_shifted(e, first) for e in plan.backward)
            decisions.extend(replace(d, indices=tuple(i + first for i in d.indices)) for d in plan.decisions)
        return FusionPlan(
            op_names=[op.op_name() for op in self.ops],
            forward=forward,
            backward=backward,
            decisions=decisions,
            fusion_enabled=current_settings().fusion,
            dtype=template.dtype if template else dtype,
            device=template.device if template else device,
            requires_grad=True,
        )
