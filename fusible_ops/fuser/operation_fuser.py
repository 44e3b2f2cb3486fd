"""OperationFuser: runs a list of basic ops as one autograd Function, fused per a plan."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import torch

from ..core.buffers import GRAD_BUFFER_WRITES, GRAD_INPUT_BUFFER_KEY, call_buffers, check_call_buffers
from ..core.dtypes import compute_dtype
from ..core.op import NO_ENTRIES, BasicOperation, TensorMeta, preflight_is_static
from ..core.settings import RECIPE_CONTEXT_USED, current_settings
from ..core.splits import forget_split_reads, start_call
from ..kernels.signature_checks import SignatureChecks, plan_takes_part
from .compiled import compiled_call, register_fuser
from .fast_path import FastCall, fast_call_of
from .function import CallState, FuserFunction, count_slices, dedupe_args, run_without_grad
from .hooks import HookedSegments, decision_in_sequential
from .op_errors import check_dense as _check_dense
from .op_errors import check_kernel_params, located_error
from .plan import FusionPlan, PlanEntry
from .recompute import call_tracking_recipe, inside_tracked_call
from .rules import (
    FusionContext,
    checked_plan,
    classify_extra_inputs,
    load_builtin_rules,
    registered_rules,
    registry_version,
)
from .signature import BoundedCache, PreparedCall, autocast_state, call_signature

# a name, not a ``torch.`` lookup, in the traced code (one guard, not one per attribute)
is_compiling = torch.compiler.is_compiling


class OperationFuser(HookedSegments):
    """Runs ``ops`` (basic ops) as one autograd Function, fused according to the plan.

    Plans are cached under everything they depend on: grad requirements, dtype,
    device, autocast, settings, which kwargs are given, which extra inputs are
    known equal, training mode and the rule registry.
    """

    def __init__(
        self,
        ops: Sequence[BasicOperation],
        *,
        honour_hooks: bool = True,
        first_index: int | None = None,
        keep_signatures: bool = True,
        recipe: Any = None,
    ) -> None:
        load_builtin_rules()
        self.ops = list(ops)
        #: the owning module's low-precision recipe, or None to follow the ``fusible_ops.quantized`` context
        self.recipe = recipe
        #: False for a fuser made for one call (an op's own ``forward``): keying the call
        #: by its signature would cost time and save none
        self.keep_signatures = keep_signatures
        #: False for an op's own ``forward`` (its hooks already ran in ``nn.Module.__call__``)
        self.honour_hooks = honour_hooks
        #: position of ``ops[0]`` in the enclosing Sequential (None: not in one), for messages
        self.first_index = first_index
        self._plans = BoundedCache()
        self._segments: dict[tuple[bool, ...], list] = {}
        self._thread_plans: threading.local | None = None
        self._prepared = BoundedCache()
        #: fast calls (see fast_path) by input shape and grad mode, and per prepared
        #: signature its FastCall or a str saying why it has none
        self._fast_index: dict[tuple, FastCall] = {}
        self._fast_calls = BoundedCache()
        self._extra_counts = [op.num_extra_inputs for op in self.ops]
        #: extra inputs a call takes, all ops together
        self.num_extra_inputs = sum(self._extra_counts)
        self._one_extra_each = all(n == 1 for n in self._extra_counts)
        #: whether every op's preflight is static (see preflight_is_static); None: not known yet
        self._static: bool | None = None
        #: the key by which a compiled call finds this fuser, or None for a fuser made for one
        #: call (it has no lasting identity to find, so its compiled calls are traced through)
        self.compiled_key = register_fuser(self) if keep_signatures else None

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_thread_plans"] = None
        # fast calls hold this fuser's parameters and guards: a copy makes its own
        state["_fast_index"], state["_fast_calls"] = {}, BoundedCache()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.compiled_key = register_fuser(self) if self.keep_signatures else None  # a copy is another fuser

    @property
    def last_plan(self) -> FusionPlan | None:
        """The plan of this thread's most recent eager call (what actually ran)."""
        local = self._thread_plans
        return getattr(local, "plan", None) if local is not None else None

    def _record_plan(self, plan: FusionPlan) -> None:
        if torch.compiler.is_compiling():
            return  # no side effect: Dynamo would rebuild the plan after every compiled call
        if self._thread_plans is None:
            self._thread_plans = threading.local()
        self._thread_plans.plan = plan

    def label(self, index: int) -> str:
        """``"op 2 (GroupedLinear)"``: ``ops[index]`` by its position in the Sequential."""
        return f"op {(self.first_index or 0) + index} ({self.ops[index].op_name()})"

    def _located(self, error: Exception, index: int, meta: TensorMeta) -> Exception:
        """``error`` from ``ops[index]``'s checks, with where the op sits (see :func:`located_error`)."""
        return located_error(self, error, index, meta)

    def _preflight_ops(
        self,
        meta: TensorMeta,
        extra_inputs: list[tuple],
        kwargs: list[dict],
        guard: list[torch.Tensor],
        input_metas: list[TensorMeta] | None = None,
    ) -> TensorMeta:
        """Each op's checks in order; returns the output meta (and appends each op's input
        meta to ``input_metas``). Also refuses buffers that overlap each other (the
        Sequential checks the whole call, see check_call_buffers)."""
        for index, (op, op_extra, op_kwargs) in enumerate(zip(self.ops, extra_inputs, kwargs)):
            if input_metas is not None:
                input_metas.append(meta)
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
    def _params(self, *, for_kernels: bool = True) -> list[list[torch.Tensor]]:
        """Each op's parameter tensors of this call (None dropped); ``for_kernels`` refuses
        sharded DTensors."""
        dicts = [op.param_tensors() for op in self.ops]
        if for_kernels:
            check_kernel_params(self.ops, dicts)
        return [[t for t in d.values() if t is not None] for d in dicts]

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
        """The :class:`FusionPlan` (forward and backward op lists, every decision) of a call with
        this input meta and, per op, these extra inputs, kwargs, grad flags and tensors."""
        settings = current_settings()
        if self.recipe is not None and settings.recipe is not self.recipe:
            settings = dataclasses.replace(settings, recipe=self.recipe)  # the module's recipe wins
        if params is None:
            params = self._params()
        classes, kinds = classify_extra_inputs(extra_inputs)
        kwarg_keys = tuple(
            frozenset(k for k, v in op_kwargs.items() if v is not None) for op_kwargs in kwargs
        )
        # traced: no cache key, no read, no write (Dynamo would guard on the cache's
        # contents and replay the write, recompiling whenever an eager call adds a plan)
        tracing = torch.compiler.is_compiling()
        key = None
        if not tracing:
            key = (
                settings,
                input_meta.dtype,
                input_meta.device,
                autocast_state(input_meta.device),
                tuple(grad_flags),
                tuple((p.dtype, p.device, type(p)) for op_params in params for p in op_params),
                kwarg_keys,
                classes,
                kinds,
                tuple(op.training for op in self.ops),
                registry_version(),
            )
        plan = None if tracing else self._plans.get(key)
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
            if not tracing:
                self._plans.put(key, plan)
        return plan

    def _make_plan(self, context: FusionContext) -> FusionPlan:
        base = []
        recipe = context.settings.recipe
        for i, op in enumerate(self.ops):
            if recipe is not None and hasattr(op, "plan_quantized"):
                choice = op.plan_quantized(context.device, context.dtype, context.settings)
            else:
                choice = op.plan_backend(context.device, context.dtype)
            base.append(PlanEntry(op, (i,), choice))
        forward = backward = base
        if context.settings.fusion:
            context.kind = "joint"
            for rule in registered_rules("joint"):
                forward = checked_plan(rule, rule(forward, context), self.ops, "joint")
            backward = forward
            context.kind = "forward"
            for rule in registered_rules("forward"):
                forward = checked_plan(rule, rule(forward, context), self.ops, "forward")
            if context.requires_grad:
                context.kind = "backward"
                for rule in registered_rules("backward"):
                    backward = checked_plan(rule, rule(backward, context), self.ops, "backward")
        return FusionPlan(
            op_names=[op.op_name() for op in self.ops],
            forward=list(forward),
            backward=list(backward),
            decisions=[decision_in_sequential(d, self.first_index or 0) for d in context.decisions],
            fusion_enabled=context.settings.fusion,
            dtype=context.dtype,
            device=context.device,
            requires_grad=context.requires_grad,
            first_index=self.first_index or 0,
            recipe=recipe,
        )

    # ------------------------------------------------------------ running
    def split_extra_inputs(self, extra_inputs: Sequence[Any]) -> list[tuple[Any, ...]]:
        """Per op, a tuple of its ``num_extra_inputs`` values (``ValueError`` on a wrong count)."""
        counts = self._extra_counts
        if self._one_extra_each and len(extra_inputs) == len(counts):
            return [(value,) for value in extra_inputs]
        needed = sum(counts)
        if len(extra_inputs) != needed:
            detail = ", ".join(f"{op.op_name()} takes {op.num_extra_inputs}" for op in self.ops)
            raise ValueError(f"expected {needed} extra input(s) ({detail}), got {len(extra_inputs)}")
        result, start = [], 0
        for op in self.ops:
            result.append(tuple(extra_inputs[start : start + op.num_extra_inputs]))
            start += op.num_extra_inputs
        return result

    def preflight(
        self,
        input_: torch.Tensor,
        extra_inputs: list[tuple],
        kwargs: list[dict],
        params: list[list],
        input_metas: list[TensorMeta] | None = None,
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
        return self._preflight_ops(meta, extra_inputs, kwargs, guard, input_metas)

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
        start_call()  # split-size values are read afresh, as in a call
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

    def __call__(
        self,
        input_: torch.Tensor,
        *extra_inputs: Any,
        basic_op_kwargs: Sequence[dict[str, Any] | None] | None = None,
        param_dicts: list[dict[str, torch.Tensor | None]] | None = None,
    ):
        """``param_dicts``: each op's parameter tensors for this call (default: what
        :meth:`~BasicOperation.param_tensors` reads; a compiled call passes its graph's)."""
        compiling = is_compiling()
        if compiling:
            if param_dicts is None:
                result = compiled_call(self, self.ops, input_, extra_inputs, basic_op_kwargs)
                if result is not None:
                    return result
        else:
            if basic_op_kwargs is None and param_dicts is None and isinstance(input_, torch.Tensor):
                fast = self._fast_index.get((input_.shape, torch.is_grad_enabled()))
                if fast is not None:
                    result = fast(self, input_, extra_inputs)
                    if result is not None:
                        return result
            forget_split_reads()  # what start_call does in eager
            if RECIPE_CONTEXT_USED[0] and self.recipe is None and not inside_tracked_call():
                return call_tracking_recipe(
                    self, input_, *extra_inputs, basic_op_kwargs=basic_op_kwargs, param_dicts=param_dicts
                )
        keyed = None
        # compiling: traced once per graph, the plan is made while tracing
        if (
            not compiling
            and (basic_op_kwargs is None or not any(basic_op_kwargs))
            and self._may_reuse(extra_inputs)
        ):
            if param_dicts is None:
                param_dicts = [op.param_tensors() for op in self.ops]
            keyed = call_signature(self.ops, input_, extra_inputs, param_dicts)
            prepared = None if keyed is None else self._prepared.get(keyed[0])
            if prepared is not None:
                result = self._run_prepared(prepared, input_, extra_inputs, keyed[1], param_dicts)
                fast_call_of(self, keyed[0], prepared, input_, extra_inputs, param_dicts)
                return result
        per_op_extra = self.split_extra_inputs(extra_inputs)
        if basic_op_kwargs is None:
            kwargs = [{} for _ in self.ops]
        else:
            kwargs = [dict(k) if k else {} for k in basic_op_kwargs]
        if self.honour_hooks and any(op.has_hooks() for op in self.ops):
            return self._call_segmented(input_, per_op_extra, kwargs, [op.hook_reason() for op in self.ops])
        if param_dicts is None:
            param_dicts = [op.param_tensors() for op in self.ops]
        check_kernel_params(self.ops, param_dicts)
        if keyed is None:
            flat_extra = [t for op_extra in per_op_extra for t in op_extra]
            flat_params = [t for d in param_dicts for t in d.values() if t is not None]
            unique_args, slots = dedupe_args(flat_extra + flat_params)
        else:
            _, unique_args, slots = keyed
        prepared = self._prepare(input_, per_op_extra, kwargs, param_dicts, slots, len(unique_args))
        if keyed is not None:
            self._prepared.put(keyed[0], prepared)
        return self._run_prepared(
            prepared, input_, extra_inputs, unique_args, param_dicts, kwargs, checked=True
        )

    def _may_reuse(self, extra_inputs: tuple) -> bool:
        """Whether an eager call without op kwargs may reuse a prepared call (see fuser_signature)."""
        if not self.keep_signatures:
            return False
        if self._static is None:
            self._static = all(preflight_is_static(op) for op in self.ops)
        return (
            self._static
            and len(extra_inputs) == self.num_extra_inputs
            and not (self.honour_hooks and any([op.has_hooks() for op in self.ops]))
        )

    def _run_prepared(
        self,
        prepared: PreparedCall,
        input_: torch.Tensor,
        extra_inputs: tuple,
        unique_args: list,
        param_dicts: list[dict[str, torch.Tensor | None]],
        kwargs: list[dict] | None = None,
        *,
        checked: bool = False,
    ):
        """Run a prepared call; ``checked``: its checks ran for this call (else the value checks run)."""
        if not checked:
            for index, meta, extra in prepared.value_checks:
                try:
                    self.ops[index].check_values(meta, extra_inputs[extra])
                except (ValueError, TypeError) as error:
                    raise self._located(error, index, meta) from None
        self._record_plan(prepared.plan)
        if prepared.state is not None:
            return FuserFunction.apply(input_, prepared.state, *unique_args)
        # nothing needs a gradient: no autograd Function, the plan runs directly
        if kwargs is None:
            kwargs = [NO_ENTRIES] * len(self.ops)
        per_op_extra = self.split_extra_inputs(extra_inputs)
        checks = prepared.signature_checks
        return run_without_grad(prepared.plan, self.ops, input_, per_op_extra, kwargs, param_dicts, checks)

    def _prepare(
        self,
        input_: torch.Tensor,
        extra_inputs: list[tuple],
        kwargs: list[dict],
        param_dicts: list[dict[str, torch.Tensor | None]],
        slots: list[int],
        num_args: int,
    ) -> PreparedCall:
        """Every check of the call, its plan and its autograd Function's state."""
        params = [[t for t in d.values() if t is not None] for d in param_dicts]
        input_metas: list[TensorMeta] = []
        self.preflight(input_, extra_inputs, kwargs, params, input_metas)
        grad_flags = self._grad_flags(input_.requires_grad, extra_inputs, params)
        meta = TensorMeta(tuple(input_.shape), input_.dtype, input_.device)
        plan = self.plan(meta, extra_inputs, kwargs, grad_flags, params)
        value_checks: tuple = ()
        if not torch.compiler.is_compiling():  # traced calls keep no prepared call
            extra_slices = count_slices(self._extra_counts)
            value_checks = tuple(
                (i, input_metas[i], extra_slices[i])
                for i, op in enumerate(self.ops)
                if type(op).check_values is not BasicOperation.check_values
            )
        # traced calls keep no prepared call: nothing to remember
        checks = None if torch.compiler.is_compiling() else SignatureChecks(plan_takes_part(plan))
        if not any(flag[0] for flag in grad_flags):
            return PreparedCall(plan, None, value_checks, checks)
        self._check_not_inference(input_, extra_inputs, params)
        tracing = torch.compiler.is_compiling()
        state = CallState(
            ops=self.ops,
            labels=[self.label(i) for i in range(len(self.ops))],
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
            num_args=num_args,
            grad_buffers=[]
            if tracing
            else [
                (i, k[GRAD_INPUT_BUFFER_KEY])
                for i, k in enumerate(kwargs)
                if isinstance(k.get(GRAD_INPUT_BUFFER_KEY), torch.Tensor)
            ],
            forward_time=0 if tracing else GRAD_BUFFER_WRITES.now(),
            signature_checks=checks,
        )
        return PreparedCall(plan, state, value_checks, checks)
