"""Compiled fuser calls: the whole call as one in-graph function, guarded on a few facts.

When Dynamo traces a fuser call by inlining it, it guards on every Python value the call
reads: the checks, the plan's cache key, the fusion rules, the backend choice, each op's
methods and attributes. At ``bench --small``'s shape that was 388 guards against 34 for
a plain ``torch._grouped_mm`` composition, and checking them on every compiled call was
the whole gap between the two (docs/benchmarks.md).

So for a fuser of the library's own ops, a compiled call reads only what its plan
depends on (the *facts*) and hands everything else to :func:`fuser_in_graph`, which
Dynamo puts in its graph as one call without tracing into it
(``torch._dynamo.allow_in_graph``). AOTAutograd then traces that function, with the
call's tensors as inputs: the same checks, plan, autograd Function and custom ops as an
eager call, run once per compilation. Dynamo guards the tensors (as for any module) and
the facts:

- the settings in force (:class:`~fusible_ops.settings.Settings`, as a key per distinct value);
- the state of the fusion-rule and kernel-backend registries, and that the former holds
  only the library's rules (one number, :mod:`fusible_ops.core.registry_versions`);
- each op's ``training`` flag and its configuration (:meth:`BasicOperation.compile_facts`);
- which parameters each op has (a ``None`` bias, a parametrization's extra tensors).

A change to any of them recompiles, as a change to a traced read would. The library's
op classes and rules are trusted not to change at run time (as Dynamo trusts ``torch``'s
own functions): patching their methods needs ``torch._dynamo.reset()``.

Everything else keeps the inlined path, where every read is guarded: ops of other
classes (a user's op, a subclass of a library op), a user's fusion rule, op kwargs (caller
buffers), extra inputs that are not tensors (split sizes as a list), ops with hooks,
``torch.export``, and a fuser made while tracing (an op's own ``forward``).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..core.op import has_module_hooks
from ..core.registry_versions import COMPILED_CALLS_KEY
from ..core.settings import THREAD_SETTINGS
from ..kernels.signature_checks import is_library_op

if TYPE_CHECKING:
    from ..core.op import BasicOperation
    from .operation_fuser import OperationFuser

# names, not ``torch.`` lookups, in the traced code: Dynamo checks in Python that each
# module's ``torch`` global is the same object as another's it reads
Tensor = torch.Tensor
is_exporting = torch.compiler.is_exporting

_FUSERS: weakref.WeakValueDictionary[int, OperationFuser] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def register_fuser(fuser: OperationFuser) -> int | None:
    """The key under which :func:`fuser_in_graph` finds ``fuser``, or None when its
    compiled calls are traced through (an op that is not the library's own, or a fuser
    made while tracing, which has no lasting identity)."""
    if torch.compiler.is_compiling():
        return None
    if not all(is_library_op(op) and op.compile_facts() is not None for op in fuser.ops):
        return None
    key = next(_KEYS)
    _FUSERS[key] = fuser
    return key


def fuser_in_graph(
    key: int,
    facts: tuple,
    param_layout: tuple[tuple[tuple[str, bool], ...], ...],
    num_extra: int,
    input_: torch.Tensor,
    *tensors: torch.Tensor,
):
    """One fuser call, with its extra inputs and then its parameters (``param_layout``: per
    op, each parameter's name and whether it is present) as ``tensors``. ``facts`` is not
    read here: it is an argument so that Dynamo guards it."""
    fuser = _FUSERS[key]
    params = iter(tensors[num_extra:])
    param_dicts = [{name: next(params) if present else None for name, present in op} for op in param_layout]
    with _ops_holding(fuser.ops, param_dicts):
        return fuser(input_, *tensors[:num_extra], param_dicts=param_dicts)


class _ops_holding:  # noqa: N801 (a context manager, named for the with statement)
    """Each op's registered parameters replaced by this call's tensors while it runs.

    Dynamo runs :func:`fuser_in_graph` outside the caller's reparametrization (a traced
    ``functional_call`` swaps nothing for real), so the ops' checks, which read their
    attributes, would otherwise see the module's own parameters instead of the tensors
    computed with (bf16 weights passed to an fp32 module).
    """

    def __init__(self, ops: Sequence[BasicOperation], param_dicts: list[dict[str, Any]]) -> None:
        self.swaps = [
            (op._parameters, name, op._parameters[name], tensor)
            for op, params in zip(ops, param_dicts)
            for name, tensor in params.items()
            if name in op._parameters and name not in op.__dict__ and op._parameters[name] is not tensor
        ]

    def __enter__(self) -> None:
        for registered, name, _, tensor in self.swaps:
            registered[name] = tensor

    def __exit__(self, *exc: object) -> None:
        for registered, name, original, _ in self.swaps:
            registered[name] = original


def _allow_fuser_in_graph() -> bool:
    """Marks :func:`fuser_in_graph` for Dynamo. Run for real while tracing (a constant
    result): marking it at import would import ``torch._dynamo`` (about 2 s) with the package."""
    import torch._dynamo

    torch._dynamo.allow_in_graph(fuser_in_graph)
    return True


_allow_fuser_in_graph._dynamo_marked_constant = True  # what assume_constant_result sets (torch 2.13)


def compiled_call(
    fuser: OperationFuser,
    ops: Sequence[BasicOperation],
    input_: torch.Tensor,
    extra_inputs: Sequence[Any],
    basic_op_kwargs: Sequence[dict[str, Any] | None] | None,
):
    """The traced call as one :func:`fuser_in_graph` node, or None where the call must be
    traced through (see the module docstring). ``ops``: the fuser's ops, as the caller
    reached them (Dynamo checks in Python that two paths to one object agree)."""
    key = fuser.compiled_key
    if key is None or is_exporting() or (basic_op_kwargs is not None and any(basic_op_kwargs)):
        return None
    for value in extra_inputs:
        if not isinstance(value, Tensor):
            return None
    if fuser.honour_hooks:
        for op in ops:
            if has_module_hooks(op):
                return None
    # the global facts as two ints (one guard each), read directly, not through functions
    registries = COMPILED_CALLS_KEY[0]
    if registries < 0:
        return None  # a user's fusion rule is registered
    param_dicts = [op.param_tensors() for op in ops]
    param_layout = tuple(tuple((name, t is not None) for name, t in d.items()) for d in param_dicts)
    params = [t for d in param_dicts for t in d.values() if t is not None]
    facts = (
        THREAD_SETTINGS.facts_key,
        registries,
        tuple([(op.training, op.compile_facts()) for op in ops]),
        fuser.recipe,
    )
    _allow_fuser_in_graph()
    return fuser_in_graph(key, facts, param_layout, len(extra_inputs), input_, *extra_inputs, *params)
