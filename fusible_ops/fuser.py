"""OperationFuser: runs a list of basic ops as one autograd Function, fused per a plan."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .dtypes import compute_dtype
from .fusion_rules import FusionContext, registered_rules, registry_version
from .op import BasicOperation, OperationContext, TensorMeta
from .plan import FusionPlan, PlanEntry
from .settings import current_settings

_MAX_CACHED_PLANS = 32
_CHEAP_COMPARE_NUMEL = 4096


def _extra_input_identity(value: Any) -> tuple[tuple, str]:
    """A key under which equal extra inputs collide when equality is cheap to see.

    Integer lists and small integer CPU tensors compare by value; anything else (a
    device tensor, whose values would need a host sync) only by identity.
    """
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return ("values", tuple(value)), "list"
    if isinstance(value, torch.Tensor):
        kind = f"{value.device.type} tensor"
        if (
            value.device.type == "cpu"
            and not value.is_floating_point()
            and value.dim() == 1
            and value.numel() <= _CHEAP_COMPARE_NUMEL
        ):
            return ("values", tuple(value.tolist())), kind
        return ("object", id(value)), kind
    return ("object", id(value)), type(value).__name__


def _classify_extra_inputs(
    extra_inputs: list[tuple[Any, ...]],
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[str, ...], ...]]:
    seen: dict[tuple, int] = {}
    classes, kinds = [], []
    for op_inputs in extra_inputs:
        op_classes, op_kinds = [], []
        for value in op_inputs:
            identity, kind = _extra_input_identity(value)
            op_classes.append(seen.setdefault(identity, len(seen)))
            op_kinds.append(kind)
        classes.append(tuple(op_classes))
        kinds.append(tuple(op_kinds))
    return tuple(classes), tuple(kinds)


def _autocast_state(device: torch.device) -> tuple:
    if torch.is_autocast_enabled(device.type):
        return (True, torch.get_autocast_dtype(device.type))
    return (False, None)


@dataclass
class _CallState:
    """Non-tensor state handed to the autograd Function for one call."""

    fuser: OperationFuser
    plan: FusionPlan
    kwargs: list[dict[str, Any]]
    extra_counts: list[int]
    param_counts: list[int]
    ctx_flags: list[tuple[bool, bool, bool]]
    #: parameters and their version counters at forward time (ints, not tensors):
    #: parameters are read in backward, so an in-place change in between is an error
    params: list[list[torch.nn.Parameter]] | None = None
    param_versions: list[list[int]] | None = None
    ctxs: list[OperationContext] | None = None
    save_layout: list[tuple[int, tuple[str, ...]]] | None = None


def _owned(output: torch.Tensor, input_: torch.Tensor) -> torch.Tensor:
    """A view of a buffer or scratch tensor is returned as a plain (detached) alias.

    Autograd treats a Function output that is a view as non-modifiable in place;
    aliases of caller buffers and fresh tensors are ours to hand out, so the caller
    may modify them (``out.add_(residual)``) like any op's output. Views of the input
    keep autograd's view tracking.
    """
    if (
        isinstance(output, torch.Tensor)
        and output._is_view()
        and not (
            input_.numel() and output.untyped_storage().data_ptr() == input_.untyped_storage().data_ptr()
        )
    ):
        return output.detach()
    return output


def _check_param_versions(state: _CallState) -> None:
    for op, op_params, versions in zip(state.fuser.ops, state.params, state.param_versions):
        for param, version in zip(op_params, versions):
            if param._version != version:
                raise RuntimeError(
                    f"{op.op_name()}: a parameter of shape {list(param.shape)} was modified in place "
                    "between forward and backward; its gradient would be wrong"
                )


class _FuserFunction(torch.autograd.Function):
    @staticmethod
    def forward(func_ctx, input_: torch.Tensor, state: _CallState, *flat_args: Any):
        num_extra = sum(state.extra_counts)
        extra_flat, _ = flat_args[:num_extra], flat_args[num_extra:]
        extra_inputs, start = [], 0
        for count in state.extra_counts:
            extra_inputs.append(tuple(extra_flat[start : start + count]))
            start += count

        ctxs = []
        for requires_grad, input_requires_grad, params_require_grad in state.ctx_flags:
            ctx = OperationContext()
            ctx.requires_grad = requires_grad
            ctx.input_requires_grad = input_requires_grad
            ctx.params_require_grad = params_require_grad
            ctxs.append(ctx)

        x = input_
        extra_outputs: list[tuple[torch.Tensor, ...]] = [()] * len(ctxs)
        for entry in state.plan.forward:
            idx = entry.indices
            x, op_extra_outputs = entry.op.fuser_forward(
                [ctxs[i] for i in idx],
                x,
                basic_op_extra_inputs=[extra_inputs[i] for i in idx],
                basic_op_kwargs=[state.kwargs[i] for i in idx],
            )
            for i, outs in zip(idx, op_extra_outputs):
                extra_outputs[i] = tuple(outs)

        if state.plan.requires_grad:
            to_save: list[torch.Tensor | None] = []
            layout = []
            for ctx in ctxs:
                names = tuple(ctx.to_save_named)
                to_save.extend(ctx.to_save)
                to_save.extend(ctx.to_save_named[name] for name in names)
                layout.append((len(ctx.to_save), names))
                ctx.to_save, ctx.to_save_named = (), {}
            func_ctx.save_for_backward(*to_save)
            state.save_layout = layout
            state.ctxs = ctxs
            func_ctx.state = state

        flat_extra_outputs = [_owned(t, input_) for outs in extra_outputs for t in outs]
        if flat_extra_outputs:
            return (_owned(x, input_), *flat_extra_outputs)
        return _owned(x, input_)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(func_ctx, grad_output: torch.Tensor, *grad_extra_outputs_flat: torch.Tensor):
        state: _CallState = func_ctx.state
        ctxs = state.ctxs
        _check_param_versions(state)
        saved = func_ctx.saved_tensors
        position = 0
        for ctx, (num_positional, names) in zip(ctxs, state.save_layout):
            ctx.saved_tensors = tuple(saved[position : position + num_positional])
            position += num_positional
            ctx.saved = {name: saved[position + k] for k, name in enumerate(names)}
            position += len(names)

        ops = state.fuser.ops
        grad_extra_outputs, start = [], 0
        for op in ops:
            grad_extra_outputs.append(tuple(grad_extra_outputs_flat[start : start + op.num_extra_outputs]))
            start += op.num_extra_outputs

        grad_params: list[list[torch.Tensor | None]] = [[None] * n for n in state.param_counts]
        grad_extra_inputs: list[tuple] = [(None,) * n for n in state.extra_counts]
        grad = grad_output
        for entry in reversed(state.plan.backward):
            idx = entry.indices
            if not any(ctxs[i].requires_grad for i in idx):
                # grad requirements only switch on along the chain: nothing before needs grad
                grad = None
                break
            grad, op_grad_params, op_grad_extra = entry.op.fuser_backward(
                [ctxs[i] for i in idx],
                grad,
                basic_op_grad_extra_outputs=[grad_extra_outputs[i] for i in idx],
            )
            for i, g_params, g_extra in zip(idx, op_grad_params, op_grad_extra):
                grad_params[i] = list(g_params) if g_params else [None] * state.param_counts[i]
                grad_extra_inputs[i] = tuple(g_extra) if g_extra else (None,) * state.extra_counts[i]
        # Drop the unpacked tensors (autograd frees its own copies unless retain_graph=True);
        # the contexts stay so that a retained graph can run backward again.
        for ctx in ctxs:
            ctx.saved_tensors, ctx.saved = (), {}
        flat_extra = [g for grads in grad_extra_inputs for g in grads]
        flat_params = [g for grads in grad_params for g in grads]
        return (grad, None, *flat_extra, *flat_params)


class OperationFuser:
    """Runs ``ops`` (basic ops) as one autograd Function, fused according to the plan.

    Plans are cached under everything they depend on: grad requirements, dtype,
    device, autocast, settings, which kwargs are given, which extra inputs are
    known equal, training mode and the rule registry.
    """

    def __init__(self, ops: Sequence[BasicOperation]) -> None:
        self.ops = list(ops)
        self._plans: OrderedDict[tuple, FusionPlan] = OrderedDict()
        self.last_plan: FusionPlan | None = None

    # ------------------------------------------------------------ planning
    def _params(self) -> list[list[torch.nn.Parameter]]:
        return [list(op.parameters()) for op in self.ops]

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
                forward = rule(forward, context)
            backward = forward
            context.kind = "forward"
            for rule in registered_rules("forward"):
                forward = rule(forward, context)
            if context.requires_grad:
                context.kind = "backward"
                for rule in registered_rules("backward"):
                    backward = rule(backward, context)
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
        for op, op_kwargs in zip(self.ops, kwargs):
            op.check_kwargs(op_kwargs)
        guard = [input_]
        guard.extend(t for op_extra in extra_inputs for t in op_extra if isinstance(t, torch.Tensor))
        guard.extend(p for op_params in params for p in op_params)
        meta = TensorMeta(tuple(input_.shape), input_.dtype, input_.device)
        for op, op_extra, op_kwargs in zip(self.ops, extra_inputs, kwargs):
            meta = op.preflight(meta, op_extra, op_kwargs, guard=guard)
        return meta

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
        params = self._params()
        for op, op_kwargs in zip(self.ops, kwargs):
            op.check_kwargs(op_kwargs)
        meta = input_meta
        for op, op_extra, op_kwargs in zip(self.ops, per_op_extra, kwargs):
            meta = op.preflight(meta, op_extra, op_kwargs, guard=list(guard))
        grad_flags = self._grad_flags(input_requires_grad, per_op_extra, params)
        return self.plan(input_meta, per_op_extra, kwargs, grad_flags), meta

    def __call__(
        self,
        input_: torch.Tensor,
        *extra_inputs: Any,
        basic_op_kwargs: Sequence[dict[str, Any] | None] | None = None,
    ):
        per_op_extra = self.split_extra_inputs(extra_inputs)
        if basic_op_kwargs is None:
            kwargs = [{} for _ in self.ops]
        else:
            kwargs = [dict(k) if k else {} for k in basic_op_kwargs]
        params = self._params()
        self.preflight(input_, per_op_extra, kwargs, params)
        grad_flags = self._grad_flags(input_.requires_grad, per_op_extra, params)
        meta = TensorMeta(tuple(input_.shape), input_.dtype, input_.device)
        plan = self.plan(meta, per_op_extra, kwargs, grad_flags, params)
        self.last_plan = plan
        state = _CallState(
            fuser=self,
            plan=plan,
            kwargs=kwargs,
            extra_counts=[op.num_extra_inputs for op in self.ops],
            param_counts=[len(p) for p in params],
            ctx_flags=grad_flags,
            params=params,
            param_versions=[[p._version for p in op_params] for op_params in params],
        )
        flat_extra = [t for op_extra in per_op_extra for t in op_extra]
        flat_params = [p for op_params in params for p in op_params]
        return _FuserFunction.apply(input_, state, *flat_extra, *flat_params)
