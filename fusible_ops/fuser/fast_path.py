"""The fuser's fast path: one call signature's eager call, guarded in a few checks.

A fuser keeps, per call signature, every metadata check and the plan (see
:mod:`.signature`). Finding them still means computing the signature, and running
them means the general plan machinery: per-op contexts, kwargs, result checks. Once a
signature's calls have passed every check (forward, and backward when it computes
gradients), and its plan is one fused op that can bind itself to the signature
(``bind_call``), the fuser keeps a :class:`FastCall`: the signature's facts as guards,
and the bound op. A later call whose guards hold runs the ops' value checks (split
sizes, on every call) and then the bound op directly: no signature, no contexts.

A fuser finds its fast calls by the input's shape and the grad mode. The guards cover
everything the signature holds: every tensor's type, shape, strides, dtype, device,
dispatch keys and ``requires_grad`` (one ``TensorGuards`` check, the check Dynamo's
compiled frames run), the type and length of a list of split sizes, which extra inputs
are the same object, each parameter's identity (so ``functional_call`` and
parametrizations miss), the grad, inference and autocast modes, the settings, the rule
registry, the ops' training flags and hooks, and that no dispatch mode or functorch
transform is active. A call that misses takes the general path, which is always
correct; nothing here changes what is computed.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..core.settings import RECIPE_CONTEXT_USED, THREAD_SETTINGS
from ..core.splits import forget_split_reads
from .function import _owned, unfrozen_error
from .recompute import inside_tracked_call
from .rules import _registry_version as _REGISTRY_VERSION
from .rules import compares_by_value, registry_version
from .signature import autocast_state

try:  # the guard Dynamo's compiled frames use; without it there is no fast path
    from torch._C._dynamo.guards import TensorGuards
except ImportError:  # pragma: no cover - every supported torch has it
    TensorGuards = None

_is_grad_enabled = torch.is_grad_enabled
_is_inference_mode_enabled = torch.is_inference_mode_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack
_is_autocast_enabled = torch.is_autocast_enabled
_functorch_transforms = torch._C._are_functorch_transforms_active
_training = operator.attrgetter("training")
_referent = weakref.ref.__call__


def _is_list(value: object) -> bool:
    return type(value) is list

#: a signature whose fast call was rebuilt this many times (its guards failing on new
#: parameter objects or strides) gets none any more: it would cost a rebuild per call
MAX_REBUILDS = 4


def _picker(positions: list[int]) -> Callable[[tuple], tuple]:
    """``values -> tuple(values[i] for i in positions)``, in C where it can be."""
    if len(positions) >= 2:
        return operator.itemgetter(*positions)
    if positions:
        (position,) = positions
        return lambda values: (values[position],)
    return lambda values: ()


def fast_path_reason(fuser: Any, prepared: Any, extra_inputs: tuple, param_dicts: list) -> str | None:
    """Why this prepared call gets no fast path (None: it can have one)."""
    if TensorGuards is None:
        return "torch has no TensorGuards"
    plan = prepared.plan
    if len(plan.forward) != 1 or len(plan.backward) != 1 or plan.forward[0].op is not plan.backward[0].op:
        return "the plan is not one fused op"
    if not hasattr(plan.forward[0].op, "bind_call"):
        return f"{type(plan.forward[0].op).__name__} cannot bind a call"
    if plan.recipe is not None:
        return "a low-precision recipe"
    if any(type(value) is not torch.Tensor and type(value) is not list for value in extra_inputs):
        return "an extra input that is neither a plain tensor nor a list"
    distinct = list({id(value): value for value in extra_inputs}.values())
    if sum([compares_by_value(value) for value in distinct]) > 1:
        # the plan depends on whether their values are equal, which no guard checks
        return "distinct split-size tensors, whose values the plan compares"
    for op, params in zip(fuser.ops, param_dicts):
        registered = op._parameters
        for name, tensor in params.items():
            if tensor is not None and (registered.get(name) is not tensor or name in op.__dict__):
                return f"{op.op_name()}.{name} is not a registered parameter"
    return None


class FastCall:
    """One prepared call signature of a fuser: its guards and its bound op.

    ``__call__(fuser, input_, extra_inputs)`` returns the call's result, or None when a
    guard fails (the caller then takes the general path). It keeps no reference to the
    fuser (which keeps it) and only weak ones to the parameters, so a replaced parameter
    or a dropped module is freed as it would be without it.
    """

    __slots__ = (
        "ops", "plan", "bound", "requires_grad", "tracks_recipe", "facts_key", "grad_enabled",
        "inference_mode", "registry", "device_type", "autocast", "training", "hook_dicts",
        "param_dicts", "param_names", "param_refs", "num_extra", "pair_left", "pair_right",
        "pairs_same", "pick_distinct", "pick_lists", "list_lengths", "tensor_guard", "value_checks",
        "frozen", "rebuilds",
    )  # fmt: skip

    def __init__(
        self,
        fuser: Any,
        prepared: Any,
        bound: Any,
        input_: torch.Tensor,
        extra_inputs: tuple,
        param_dicts: list[dict[str, torch.Tensor | None]],
    ) -> None:
        self.ops = tuple(fuser.ops)
        self.plan = prepared.plan
        self.bound = bound
        self.requires_grad = prepared.state is not None
        #: a differentiable forward of a fuser without its own recipe, which must record its
        #: context recipe once a recipe context was used (see recompute)
        self.tracks_recipe = self.requires_grad and fuser.recipe is None
        self.facts_key = THREAD_SETTINGS.facts_key
        self.grad_enabled = _is_grad_enabled()
        self.inference_mode = _is_inference_mode_enabled()
        self.registry = registry_version()
        self.device_type = "cpu" if input_.is_cpu else input_.device.type
        self.autocast = autocast_state(self.device_type)
        self.training = tuple(op.training for op in self.ops)
        # the hook dicts nn.Module's register_*_hook methods add to (in place)
        self.hook_dicts = tuple(
            d
            for op in self.ops
            for d in (op._forward_pre_hooks, op._forward_hooks, op._backward_hooks, op._backward_pre_hooks)
        )
        named = [(op, name, t) for op, params in zip(self.ops, param_dicts) for name, t in params.items()]
        named = [entry for entry in named if entry[2] is not None]
        self.param_dicts = tuple(op._parameters for op, _, _ in named)
        self.param_names = tuple(name for _, name, _ in named)
        params = tuple(t for _, _, t in named)
        self.param_refs = tuple(weakref.ref(t) for t in params)
        n = self.num_extra = len(extra_inputs)
        pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
        self.pair_left = _picker([i for i, _ in pairs])
        self.pair_right = _picker([j for _, j in pairs])
        self.pairs_same = tuple(extra_inputs[i] is extra_inputs[j] for i, j in pairs)
        # each distinct tensor once (a TensorGuards check fails on the same tensor twice);
        # lists (split sizes) by type and length, their values checked on every call
        distinct = [i for i in range(n) if all(extra_inputs[i] is not extra_inputs[j] for j in range(i))]
        tensor_positions = [i for i in distinct if type(extra_inputs[i]) is torch.Tensor]
        self.pick_distinct = None if len(tensor_positions) == n else _picker(tensor_positions)
        list_positions = [i for i in distinct if type(extra_inputs[i]) is list]
        self.pick_lists = _picker(list_positions) if list_positions else None
        self.list_lengths = tuple(len(extra_inputs[i]) for i in list_positions)
        tensors = (input_, *[extra_inputs[i] for i in tensor_positions], *params)
        self.tensor_guard = TensorGuards(
            *tensors,
            dynamic_dims_sizes=[list(t.shape) for t in tensors],
            dynamic_dims_strides=[list(t.stride()) for t in tensors],
        )
        # one of each set of equal value checks on the same extra inputs (see value_check_key)
        first_seen = [next(j for j in range(n) if extra_inputs[j] is extra_inputs[i]) for i in range(n)]
        checks, keys = [], set()
        for index, meta, part in prepared.value_checks:
            key = self.ops[index].value_check_key(meta)
            if key is not None:
                key = (key, tuple(first_seen[part]))
                if key in keys:
                    continue
                keys.add(key)
            checks.append((index, meta, part, self.ops[index].bind_value_check(meta)))
        self.value_checks = tuple(checks)
        #: ``(op, name, position)`` of the parameters that needed no gradient at forward
        #: (backward refuses them unfrozen)
        self.frozen = tuple((op, name, k) for k, (op, name, t) in enumerate(named) if not t.requires_grad)
        self.rebuilds = 0

    def guards_hold(self, input_: torch.Tensor, extra_inputs: tuple) -> tuple | None:
        """The call's parameters when it has the signature this fast call was made for, else None."""
        # each parameter read as param_tensors reads it: the same object as when bound
        params = tuple(map(dict.get, self.param_dicts, self.param_names))
        if (
            not all(map(operator.is_, params, map(_referent, self.param_refs)))
            or
            len(extra_inputs) != self.num_extra
            or THREAD_SETTINGS.facts_key != self.facts_key
            or _is_grad_enabled() is not self.grad_enabled
            or _is_inference_mode_enabled() is not self.inference_mode
            or _REGISTRY_VERSION[0] != self.registry
            or _dispatch_modes()
            or _functorch_transforms()
            # a differentiable forward that must record its context recipe (see recompute)
            or (RECIPE_CONTEXT_USED[0] and self.tracks_recipe and not inside_tracked_call())
            or any(self.hook_dicts)
            or tuple(map(_training, self.ops)) != self.training
            or tuple(map(operator.is_, self.pair_left(extra_inputs), self.pair_right(extra_inputs)))
            != self.pairs_same
        ):
            return None
        enabled, dtype = self.autocast
        if _is_autocast_enabled(self.device_type) is not enabled or (
            enabled and torch.get_autocast_dtype(self.device_type) != dtype
        ):
            return None
        pick_lists = self.pick_lists
        if pick_lists is not None:
            lists = pick_lists(extra_inputs)
            if not all(map(_is_list, lists)) or tuple(map(len, lists)) != self.list_lengths:
                return None
        pick = self.pick_distinct
        distinct = extra_inputs if pick is None else pick(extra_inputs)
        return params if self.tensor_guard.check(input_, *distinct, *params) else None

    def __call__(self, fuser: Any, input_: torch.Tensor, extra_inputs: tuple) -> Any:
        params = self.guards_hold(input_, extra_inputs)
        if params is None:
            return None
        forget_split_reads()
        for index, meta, part, check in self.value_checks:
            try:
                if check is None:
                    self.ops[index].check_values(meta, extra_inputs[part])
                else:
                    check(extra_inputs[part])
            except (ValueError, TypeError) as error:
                raise fuser._located(error, index, meta) from None
        fuser._thread_plans.plan = self.plan
        if not self.requires_grad:
            return self.bound.forward(input_, extra_inputs, params, False)[0]
        # Function.apply's Python part only handles functorch transforms, which the guards exclude
        return _apply(input_, self, extra_inputs, params, *extra_inputs, *params)


class FastFunction(torch.autograd.Function):
    """The autograd Function of a :class:`FastCall` (eager only).

    Receives every extra input and parameter as an argument (a tensor given twice gets
    two gradients, which autograd adds); saves the parameters like any input autograd
    keeps, so an in-place change before backward is caught by autograd's version check.
    """

    @staticmethod
    def forward(ctx, input_: torch.Tensor, fast: FastCall, extra_inputs: tuple, params: tuple, *args: Any):
        y, saved, facts = fast.bound.forward(input_, extra_inputs, params, True)
        ctx.save_for_backward(*params, *saved)
        ctx.fast, ctx.facts, ctx.num_params = fast, facts, len(params)
        return _owned(y, input_) if y._is_view() else y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        fast: FastCall = ctx.fast
        saved, num_params = ctx.saved_tensors, ctx.num_params
        for op, name, position in fast.frozen:
            if saved[position].requires_grad:
                raise unfrozen_error(op, name)
        grad_input, grad_extra, grad_params = fast.bound.backward(
            saved[num_params:], ctx.facts, saved[:num_params], grad_output
        )
        return (grad_input, None, None, None, *grad_extra, *grad_params)


# the C entry point under torch.autograd.Function.apply
_apply = super(torch.autograd.Function, FastFunction).apply


def fast_call_of(
    fuser: Any,
    key: tuple,
    prepared: Any,
    input_: torch.Tensor,
    extra_inputs: tuple,
    param_dicts: list[dict[str, torch.Tensor | None]],
) -> FastCall | None:
    """The fast call of ``fuser``'s prepared signature ``key`` (this call's), made the first
    time it is needed once every check of the signature has passed (forward, and backward
    when it computes gradients); None when it has none (yet). Why it has none is kept in
    ``fuser._fast_calls`` in its place. A fast call is also indexed by the input's shape and
    the grad mode, where a call looks it up."""
    known = fuser._fast_calls.get(key)
    if type(known) is str:
        return None
    if known is not None and known.guards_hold(input_, extra_inputs) is not None:
        return _indexed(fuser, known, input_)
    checks = prepared.signature_checks
    if checks is None or not checks.forward or (prepared.state is not None and not checks.backward):
        return None  # not every check has passed yet
    rebuilds = 0 if known is None else known.rebuilds + 1
    reason = fast_path_reason(fuser, prepared, extra_inputs, param_dicts)
    if reason is None and rebuilds > MAX_REBUILDS:
        reason = "its guards kept failing (new parameter tensors or strides on every call)"
    bound = None
    if reason is None:
        op = prepared.plan.forward[0].op
        grad_flags = None if prepared.state is None else prepared.state.ctx_flags
        bound = op.bind_call(input_, extra_inputs, param_dicts, grad_flags)
        if bound is None:
            reason = f"{type(op).__name__} declined to bind this signature"
    if reason is not None:
        fuser._fast_calls.put(key, reason)
        return None
    fast = FastCall(fuser, prepared, bound, input_, extra_inputs, param_dicts)
    fast.rebuilds = rebuilds
    fuser._fast_calls.put(key, fast)
    return _indexed(fuser, fast, input_)


#: fast calls a fuser indexes (by input shape and grad mode) before it starts afresh
MAX_INDEXED = 16


def _indexed(fuser: Any, fast: FastCall, input_: torch.Tensor) -> FastCall:
    """``fast``, found by the next call with this input shape and grad mode (one lookup)."""
    index = fuser._fast_index
    if len(index) >= MAX_INDEXED:
        index.clear()
    index[(input_.shape, fast.grad_enabled)] = fast
    return fast
