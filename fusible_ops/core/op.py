"""Operation classes: the per-call context, basic ops (own parameters) and fused ops.

A *basic op* says what one small step computes and what it saves for backward.
A *fused op* replaces a run of basic ops in forward, backward or both, and computes
the same thing with their parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

from .state_dict_checks import CheckedLoadStateDict

#: an empty mapping that refuses writes (shared defaults: contexts, kwargs of calls without any)
NO_ENTRIES: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and device of a tensor that has not been computed yet."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


class OpBackward(NamedTuple):
    """What :meth:`BasicOperation.op_backward` returns.

    ``grad_params``: one per parameter in ``param_names`` order, absent (None) parameters
    left out; ``grad_extra_inputs``: one per extra input (``()``: none needs a gradient).
    """

    grad_input: torch.Tensor | None
    grad_params: Sequence[torch.Tensor | None] = ()
    grad_extra_inputs: Sequence[torch.Tensor | None] = ()


class FusedForward(NamedTuple):
    """What ``fuser_forward`` returns: the output and, per basic op, its extra outputs."""

    output: torch.Tensor
    extra_outputs: list[tuple[torch.Tensor, ...]]


class FusedBackward(NamedTuple):
    """What ``fuser_backward`` returns; both lists hold one entry per basic op, in order."""

    grad_input: torch.Tensor | None
    grad_params: list[Sequence[torch.Tensor | None]]
    grad_extra_inputs: list[Sequence[torch.Tensor | None]]


class OperationContext:
    """Per-call state of one basic op.

    Attributes set by the fuser before forward: ``requires_grad`` (backward will run
    through this op), ``input_requires_grad`` (the gradient w.r.t. this op's main input is
    needed), ``params_require_grad`` (at least one of this op's parameters needs a gradient).

    ``params``: the op's parameter tensors of this call by name (see
    :meth:`BasicOperation.param_tensors`); forward and backward compute with these,
    never with ``self.weight``, so ``functional_call``, parametrizations and FSDP work.
    Tensors for backward go through :meth:`save_for_backward`, which the fuser hands
    to the autograd context, so saved-tensor hooks see every one of them. After
    forward they are available as ``saved_tensors`` (positional) and ``saved``
    (named). Backward receives a fresh context carrying a copy of what forward set.
    ``grad_input_buffer``: the caller's ``grad_input`` buffer for this op (or None),
    set by the fuser; backward writes the input gradient there. It is a destination,
    not saved state: it stays the caller's memory even when saved-tensor hooks offload
    what is saved, and the fuser clears it in backward when writing there would be wrong.
    """

    # Immutable defaults live on the class (a context is made per op and call)
    requires_grad: bool = False
    input_requires_grad: bool = False
    params_require_grad: bool = False
    grad_input_buffer: torch.Tensor | None = None
    #: the plan entry's backend choice for this op (see BasicOperation.plan_backend)
    backend_choice: Any = None
    to_save: tuple[torch.Tensor | None, ...] = ()
    saved_tensors: tuple[torch.Tensor | None, ...] = ()

    # read-only empty mappings until the fuser or the op assigns its own (a context is
    # made per op and call: no four dicts per context)
    params: Mapping[str, torch.Tensor | None] = NO_ENTRIES
    param_requires_grad: Mapping[str, bool] = NO_ENTRIES
    to_save_named: Mapping[str, torch.Tensor | None] = NO_ENTRIES
    saved: Mapping[str, torch.Tensor | None] = NO_ENTRIES

    def save_for_backward(self, *tensors: torch.Tensor | None, **named: torch.Tensor | None) -> None:
        """Record tensors for backward (replaces anything saved earlier in this call)."""
        self.to_save = tensors
        self.to_save_named = named

    def needs_param_grad(self, name: str) -> bool:
        """Whether parameter ``name`` of this call needs a gradient (False when absent)."""
        return self.param_requires_grad.get(name, False)

    def for_backward(
        self,
        saved_tensors: tuple[torch.Tensor | None, ...],
        saved: dict[str, torch.Tensor | None],
        params: dict[str, torch.Tensor | None],
    ) -> OperationContext:
        """A copy of this context holding the unpacked saved tensors (forward's stays untouched)."""
        ctx = OperationContext()
        ctx.__dict__.update(self.__dict__)
        ctx.saved_tensors = saved_tensors
        ctx.saved = saved
        ctx.params = params
        return ctx


def fixed_at_construction(name: str, doc: str, get: Callable[[Any], Any] | None = None) -> property:
    """A read-only attribute: configuration an op or layer reads when it plans or computes,
    which a later assignment would silently not reach. Stored as ``_{name}`` and set once
    (in ``__init__``), or computed by ``get``; any other assignment raises ``AttributeError``."""
    slot = "_" + name

    def getter(self):  # noqa: ANN001, ANN202
        return getattr(self, slot) if get is None else get(self)

    def set_once(self, value) -> None:  # noqa: ANN001
        if get is not None or slot in vars(self):
            cls = type(self).__name__
            raise AttributeError(f"{cls}.{name} is fixed at construction; build a new {cls} instead")
        vars(self)[slot] = value

    getter.__doc__ = doc  # what help() and the API reference show
    return property(getter, set_once, doc=doc)


def check_sizes(op_name: str, **sizes: object) -> None:
    """Constructor sizes must be positive ints (``TypeError``/``ValueError`` naming the op)."""
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{op_name}: {name} must be an int, got {value!r} ({type(value).__name__})")
        if value < 1:
            raise ValueError(f"{op_name}: {name} must be positive, got {value}")


class FusibleOperation:
    """Anything the fuser can run: a basic op or a fused op."""

    def fuser_forward(
        self,
        basic_op_ctxs: list[OperationContext],
        input_: torch.Tensor,
        *,
        basic_op_extra_inputs: list[tuple[Any, ...]],
        basic_op_kwargs: list[dict[str, Any]],
    ) -> FusedForward:
        """Forward; returns the output and each basic op's extra outputs."""
        raise NotImplementedError(f"{type(self).__name__} has no forward implementation")

    def fuser_backward(
        self,
        basic_op_ctxs: list[OperationContext],
        grad_output: torch.Tensor,
        *,
        basic_op_grad_extra_outputs: list[tuple[torch.Tensor | None, ...]],
    ) -> FusedBackward:
        """Backward; returns grad input, each basic op's param grads and extra-input grads."""
        raise NotImplementedError(f"{type(self).__name__} has no backward implementation")


def has_module_hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` has its own forward (pre-)hooks or backward hooks (what
    :meth:`BasicOperation.has_hooks` answers; a function, so that a traced call guards
    the hooks it reads, not a method lookup per op)."""
    if (
        module._forward_pre_hooks
        or module._forward_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
    ):
        return True
    return False  # not bool(...): one builtin fewer for a traced call to guard


class BasicOperation(FusibleOperation, CheckedLoadStateDict, torch.nn.Module):
    """One small step of a network; owns its parameters.

    Simple ops implement :meth:`op_forward` and :meth:`op_backward`. Ops with extra
    inputs receive them positionally in ``op_forward`` and may return a third item
    from ``op_backward`` (their gradients). Ops with extra outputs override the
    fuser-level methods. :meth:`preflight` validates a call before any work runs.
    """

    num_extra_inputs: int = 0
    num_extra_outputs: int = 0
    #: kwargs this op accepts through ``op_kwargs``; anything else is a TypeError
    accepted_kwargs: frozenset[str] = frozenset()
    #: which of ``accepted_kwargs`` are caller buffers (checked for overlap per call)
    buffer_kwargs: tuple[str, ...] = ()
    #: names of the parameter attributes forward reads, in the order ``op_backward``
    #: returns their gradients; None: the op's own parameters in registration order
    param_names: tuple[str, ...] | None = None
    #: whether DTensor parameters may reach this op (the tensor-parallel linear ops)
    accepts_dtensor: bool = False
    #: :meth:`preflight` reads only metadata (shapes, dtypes, devices, which kwargs are
    #: given) and leaves value checks to :meth:`~fusible_ops.BasicOperation.check_values`: the fuser then runs it once
    #: per call signature and ``check_values`` on every call. It counts only on the class
    #: that defines ``preflight`` (see ``preflight_is_static``): a subclass overriding
    #: ``preflight`` is checked on every call unless it says so too.
    static_preflight: bool = True

    # ------------------------------------------------------------ parameters and hooks
    def param_tensors(self) -> dict[str, torch.Tensor | None]:
        """The tensors this call computes with, read through the attributes.

        Reading ``getattr(self, name)`` (not ``self._parameters``) is what makes
        ``torch.func.functional_call``, ``torch.nn.utils.parametrize`` and hook-based
        reparametrizations (``weight_norm``, FSDP2) reach the kernels; the fuser passes
        these tensors through autograd, so their gradients flow to whatever made them.
        """
        names = self.param_names
        if names is None:
            names = tuple(self._parameters)
            parametrized = self._modules.get("parametrizations")  # where parametrize keeps them
            if parametrized is not None:
                names += tuple(n for n in parametrized if n not in names)
        # what getattr finds, without nn.Module.__getattr__ for a registered parameter
        # (functional_call puts its tensors in _parameters; a parametrization removes the name)
        registered = self._parameters
        return {
            name: registered[name]
            if name in registered and name not in self.__dict__
            else getattr(self, name)
            for name in names
        }

    def compile_facts(self) -> tuple | None:
        """The op's configuration as Python literals: everything its checks, plans and
        math read besides tensors and ``training``. A compiled call of the library's own
        ops guards on these instead of tracing through them (see
        ``fusible_ops.fuser.compiled``); None (the default): its calls are traced through."""
        return None

    def plan_backend(self, device: torch.device, dtype: torch.dtype) -> Any:
        """The kernel backend this op would run with (a ``BackendChoice``), or None.

        The fuser puts it in the plan entry and hands it to the op for the call
        (``ctx.backend_choice``), so the plan shows what runs.
        """
        return None

    def has_hooks(self) -> bool:
        """Whether :meth:`hook_reason` has a reason (checked on every call, so kept cheap)."""
        return has_module_hooks(self)

    def hook_reason(self) -> str | None:
        """Why this op must run alone through ``nn.Module.__call__`` (it has hooks), or None."""
        kinds = []
        if self._forward_pre_hooks:
            kinds.append("forward pre-hook")
        if self._forward_hooks:
            kinds.append("forward hook")
        if self._backward_hooks or self._backward_pre_hooks:
            kinds.append("backward hook")
        return " and ".join(kinds) or None

    # ------------------------------------------------------------ per-op math
    def op_forward(self, ctx: OperationContext, input_: torch.Tensor, *extra_inputs: Any, **kwargs: Any):
        """Compute this op's output; save in ``ctx`` what :meth:`op_backward` needs.

        Args:
            ctx: this op's context for the call (``ctx.save_for_backward``, ``ctx.requires_grad``,
                ``ctx.backend_choice``).
            input_: the main tensor, ``[*, in]``.
            *extra_inputs: the ``num_extra_inputs`` extra inputs this op declares, in order.
            **kwargs: this op's entry of ``op_kwargs`` (only names in ``accepted_kwargs``).

        Returns:
            The output tensor, ``[*, out]``.
        """
        raise NotImplementedError(f"{type(self).__name__}.op_forward")

    def op_backward(self, ctx: OperationContext, grad_output: torch.Tensor) -> OpBackward:
        """Gradients of this op from what :meth:`op_forward` saved in ``ctx``.

        Args:
            ctx: the context :meth:`op_forward` filled.
            grad_output: gradient of the output, shaped like it.

        Returns:
            ``OpBackward(grad_input, grad_params, grad_extra_inputs)``: the input's gradient (or
            None), one gradient (or None) per entry of ``param_names``, and one per extra input.
        """
        raise NotImplementedError(f"{type(self).__name__}.op_backward")

    def preflight(
        self,
        input_meta: TensorMeta,
        extra_inputs: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        guard: Sequence[torch.Tensor],
    ) -> TensorMeta:
        """Validate a call without computing; return the output's meta.

        ``guard`` lists the caller's tensors and all parameters of the group, which a
        caller buffer must not overlap. Raise ``ValueError`` naming the op on bad input.
        """
        return input_meta

    def check_values(self, input_meta: TensorMeta, extra_inputs: tuple[Any, ...]) -> None:
        """Checks that depend on the values of this call's extra inputs (split sizes).

        Run on every call, also when the call signature's preflight is cached; raise
        ``ValueError`` naming the op. Ops with a static preflight call it from it.
        """

    def bind_value_check(self, input_meta: TensorMeta) -> Callable[[tuple[Any, ...]], None] | None:
        """:meth:`check_values` for calls of one signature (every extra input's metadata as
        when the signature's preflight passed), as ``check(extra_inputs)``; None (the
        default): the fast path calls :meth:`check_values`."""
        return None

    def value_check_key(self, input_meta: TensorMeta) -> Any:
        """A key for :meth:`check_values` with this input meta: two ops whose keys are equal
        (not None) run the same checks on the same extra inputs, so a call runs one of them
        (the fast path, see ``fusible_ops.fuser.fast_path``). None (the default): always run."""
        return None

    def op_name(self) -> str:
        """The name error messages and plans use for this op (its class name)."""
        return type(self).__name__

    def check_kwargs(self, kwargs: dict[str, Any]) -> None:
        """Refuse ``op_kwargs`` entries this op does not accept.

        Raises:
            TypeError: a key is not in ``accepted_kwargs``.
        """
        unknown = sorted(set(kwargs) - self.accepted_kwargs)
        if unknown:
            accepted = sorted(self.accepted_kwargs) or "none"
            raise TypeError(f"{self.op_name()} got unexpected kwarg(s) {unknown}; it accepts {accepted}")

    # ------------------------------------------------------------ fuser interface
    def fuser_forward(self, basic_op_ctxs, input_, *, basic_op_extra_inputs, basic_op_kwargs) -> FusedForward:
        """The fuser-level forward: :meth:`~fusible_ops.BasicOperation.op_forward` on the one context.

        Ops with extra outputs override this instead of ``op_forward``; the arguments are
        per basic op (lists of one here), as for a :class:`FusedOperation`.

        Returns:
            ``FusedForward(output, extra_outputs_per_op)``.
        """
        output = self.op_forward(basic_op_ctxs[0], input_, *basic_op_extra_inputs[0], **basic_op_kwargs[0])
        return FusedForward(output, [()])

    def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs) -> FusedBackward:
        """The fuser-level backward: :meth:`~fusible_ops.BasicOperation.op_backward`, its result checked and packed.

        Returns:
            ``FusedBackward(grad_input, grad_params_per_op, grad_extra_inputs_per_op)``.

        Raises:
            TypeError: ``op_backward`` returned something other than an ``OpBackward``.
        """
        result = self.op_backward(basic_op_ctxs[0], grad_output)
        if isinstance(result, tuple) and not isinstance(result, OpBackward) and len(result) in (2, 3):
            result = OpBackward(*result)  # a plain tuple from an op written before OpBackward
        if not isinstance(result, OpBackward):
            got = (
                f"{type(result).__name__} of {len(result)}"
                if isinstance(result, (tuple, list))
                else type(result).__name__
            )
            raise TypeError(
                f"{type(self).__name__}.op_backward returned {got}; expected OpBackward(grad_input, "
                "grad_params, grad_extra_inputs) (or a (grad_input, [parameter gradients]) tuple)"
            )
        grad_extra_inputs = tuple(result.grad_extra_inputs) or (None,) * self.num_extra_inputs
        return FusedBackward(result.grad_input, [list(result.grad_params)], [grad_extra_inputs])

    # ------------------------------------------------------------ direct call
    def forward(self, input_: torch.Tensor, *extra_inputs: Any, **kwargs: Any):
        """Run this op alone: ``op(x, *extra_inputs, **kwargs)``.

        A fresh single-op fuser per call (planning one op is trivial) keeps the op
        free of a reference cycle through a cached fuser.
        """
        # hooks ran in nn.Module.__call__; the fuser lives for this call only
        return _run_alone(self, input_, extra_inputs, kwargs)


def _no_fuser(op: BasicOperation, input_: torch.Tensor, extra_inputs: tuple, kwargs: dict) -> Any:
    raise RuntimeError(f"{type(op).__name__}: fusible_ops.fuser is not imported; import fusible_ops first")


# installed by fusible_ops.fuser (a higher layer): runs one op through a fresh OperationFuser
_run_alone: Callable[[BasicOperation, torch.Tensor, tuple, dict], Any] = _no_fuser


def set_direct_call_runner(runner: Callable[[BasicOperation, torch.Tensor, tuple, dict], Any]) -> None:
    """Install the function that runs a basic op called directly (the fuser's)."""
    global _run_alone
    _run_alone = runner


_STATIC_PREFLIGHT: dict[type, bool] = {}


def preflight_is_static(op: BasicOperation) -> bool:
    """Whether ``op``'s preflight depends on metadata only (cached per class)."""
    cls = type(op)
    known = _STATIC_PREFLIGHT.get(cls)
    if known is None:
        owner = next(klass for klass in cls.__mro__ if "preflight" in klass.__dict__)
        known = _STATIC_PREFLIGHT[cls] = bool(owner.__dict__.get("static_preflight", False))
    return known


class FusedOperation(FusibleOperation):
    """Stateless replacement for a run of basic ops; uses their parameters.

    The equivalence contract, by the kind of rule that builds it (``register_fusion``):

    - ``forward``: ``fuser_forward`` computes what the basic ops' forwards compute and
      fills each basic op's context exactly as they would (the basic ops' backwards run);
    - ``backward``: ``fuser_backward`` reads the contexts the basic forwards filled and
      returns what the basic ops' backwards return;
    - ``joint``: both methods; forward may save its own, smaller state for its own backward.

    In every case the results equal the unfused ops' (to rounding), every basic op's
    kwargs are honoured or the build declines, and the returns are :class:`FusedForward`
    and :class:`FusedBackward` with one entry per basic op (the fuser checks).

    ``backend``: the kernel backend chosen when the plan was made: the ``BackendChoice``
    from ``select_backend`` (kept as ``choice``, what runs), a name, or None;
    ``note`` says anything else the plan should show (skipped backends, copies).
    """

    def __init__(self, basic_ops: Sequence[BasicOperation], *, backend: Any = None, note: str = "") -> None:
        self.basic_ops = tuple(basic_ops)
        #: the backend choice this op runs with (None when it names no choice)
        self.choice = None if backend is None or isinstance(backend, str) else backend
        self._backend_name = backend if isinstance(backend, str) else None
        #: shown in the plan next to the decision that built this op (e.g. skipped backends)
        self.note = note

    @property
    def backend(self) -> str | None:
        """The name of the backend this op runs with (what the plan shows)."""
        return self.choice.name if self.choice is not None else self._backend_name
