"""Sequential: a ``torch.nn.Sequential`` whose runs of fusible ops go through the fuser."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..core.buffers import call_buffers, check_call_buffers
from ..core.op import BasicOperation, TensorMeta
from ..core.state_dict_checks import CheckedLoadStateDict
from ..recipes.context import check_recipe
from ..recipes.recipes import Recipe
from .compiled import compiled_call
from .operation_fuser import OperationFuser
from .plan import FusionPlan, SequentialPlan

# a name, not a ``torch.`` lookup, in the traced code (one guard, not one per attribute)
is_compiling = torch.compiler.is_compiling

if TYPE_CHECKING:
    from ..core.placement import ExpertPlacement


class Sequential(CheckedLoadStateDict, torch.nn.Module):
    """Container of modules run in order; consecutive basic ops form one fuser group.

    Like ``torch.nn.Sequential``, but each run of basic ops (``fusible_ops`` ops) goes
    through an :class:`~fusible_ops.OperationFuser`, which fuses them where a rule
    applies. Any other ``nn.Module`` is a group of its own and receives only the main
    tensor. ``forward(input, *extra_inputs, op_kwargs=None)``: extra inputs are consumed
    in op order by the ops that declare them; ``op_kwargs`` maps an op (the module
    object or its index, negative allowed) to a dict of kwargs for it.

    Args:
        *modules: the modules, in the order they run.
        recipe: the low-precision recipe of this Sequential's ops (a
            ``fusible_ops.recipes`` recipe), or None (default) to follow the
            :func:`fusible_ops.quantized` context; settable later as ``seq.recipe``.

    Shape:
        input: what the first module takes, e.g. ``[*, in]``.
        extra inputs: those the ops declare, in op order (e.g. ``split_sizes`` ``[E]``
            for a :class:`~fusible_ops.GroupedLinear`, ``scales`` ``[N]`` for a scaled
            activation).
        output: what the last module returns, e.g. ``[*, out]``; ``(output,
            *extra_outputs)`` when ops produce extra outputs.

    Raises:
        TypeError: a module that is not an ``nn.Module``, or ``recipe`` that is not a recipe.
    """

    #: which global experts this Sequential holds when it is the experts block of an
    #: expert-parallel ``fo.MoE`` (set by the MoE; read by :mod:`fusible_ops.checkpoint`)
    expert_placement: ExpertPlacement | None = None

    def __init__(self, *modules: torch.nn.Module, recipe: Recipe | None = None) -> None:
        super().__init__()
        self.__dict__["_recipe"] = check_recipe("Sequential", recipe)
        for module in modules:
            self.append(module)

    @property
    def recipe(self) -> Recipe | None:
        """The low-precision recipe of this Sequential's ops, or None to follow the
        ``fusible_ops.quantized`` context. It wins over the context; setting it re-plans the next call."""
        return self.__dict__.get("_recipe")

    @recipe.setter
    def recipe(self, recipe: Recipe | None) -> None:
        self.__dict__["_recipe"] = check_recipe("Sequential", recipe)
        self.__dict__["_groups"] = self.__dict__["_route"] = None
        self._get_groups()

    # ------------------------------------------------------------ container protocol
    def _module_list(self) -> list[torch.nn.Module]:
        return list(self._modules.values())

    def _reset_modules(self, modules: list[torch.nn.Module]) -> None:
        self._modules.clear()
        for i, module in enumerate(modules):
            self._modules[str(i)] = module
        self._get_groups()

    def append(self, module: torch.nn.Module) -> Sequential:
        """Add ``module`` at the end.

        Returns:
            This Sequential.

        Raises:
            TypeError: ``module`` is not an ``nn.Module``.
        """
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"Sequential: {type(module).__name__} is not an nn.Module")
        self._modules[str(len(self._modules))] = module
        self._get_groups()  # built here, so that a first call under torch.compile finds them
        return self

    def extend(self, modules: Iterable[torch.nn.Module]) -> Sequential:
        """Append every module of ``modules``, in order.

        Returns:
            This Sequential.
        """
        for module in modules:
            self.append(module)
        return self

    def insert(self, index: int, module: torch.nn.Module) -> Sequential:
        """Insert ``module`` before position ``index`` (negative counts from the end).

        Returns:
            This Sequential.

        Raises:
            TypeError: ``module`` is not an ``nn.Module``.
            IndexError: ``index`` is outside ``[-len(self), len(self)]``.
        """
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"Sequential: {type(module).__name__} is not an nn.Module")
        modules = self._module_list()
        n = len(modules)
        if not -n <= index <= n:
            raise IndexError(f"Sequential.insert: index {index} is out of range for {n} modules")
        modules.insert(index + n if index < 0 else index, module)
        self._reset_modules(modules)
        return self

    def pop(self, index: int = -1) -> torch.nn.Module:
        """Remove the module at ``index`` (default: the last; negative counts from the end).

        Returns:
            The removed module.

        Raises:
            IndexError: ``index`` is out of range.
        """
        modules = self._module_list()
        module = modules.pop(index)
        self._reset_modules(modules)
        return module

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[torch.nn.Module]:
        return iter(self._modules.values())

    def __getitem__(self, index: int | slice) -> torch.nn.Module | Sequential:
        modules = self._module_list()
        if isinstance(index, slice):
            return Sequential(*modules[index], recipe=self.recipe)
        return modules[self._normalize_index(index)]

    def __setitem__(self, index: int, module: torch.nn.Module) -> None:
        modules = self._module_list()
        modules[self._normalize_index(index)] = module
        self._reset_modules(modules)

    def __delitem__(self, index: int | slice) -> None:
        modules = self._module_list()
        del modules[index if isinstance(index, slice) else self._normalize_index(index)]
        self._reset_modules(modules)

    def _normalize_index(self, index: int) -> int:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"Sequential index {index} is out of range for {n} modules")
        return index + n if index < 0 else index

    # ------------------------------------------------------------ groups
    def _get_groups(self, compiling: bool | None = None) -> list[tuple[list[int], OperationFuser | None]]:
        """``[(indices, fuser or None for a plain module)]`` for the current module list.

        Cached under the identity of every module, so any change to the list (``seq[i] =``,
        ``setattr(seq, "2", op)``, ``add_module``, ``del``, writing ``_modules``) takes
        effect on the next call, however it was made.
        """
        modules = tuple(self._modules.values())
        cached = self.__dict__.get("_groups")
        if compiling is None:
            compiling = torch.compiler.is_compiling()
        if cached is not None:
            known, known_ids, groups = cached
            if compiling:
                # ids (the cache keeps the modules alive): Dynamo then guards each module's
                # id, instead of checking in Python that two paths reach the same object
                if known_ids == tuple([id(module) for module in modules]):
                    return groups
            elif len(known) == len(modules) and all(map(operator.is_, known, modules)):
                return groups
        groups = []
        run: list[int] = []
        for i, module in enumerate(modules):
            if isinstance(module, BasicOperation):
                run.append(i)
                continue
            if run:
                groups.append((run, self._fuser([modules[j] for j in run], run[0])))
                run = []
            groups.append(([i], None))
        if run:
            groups.append((run, self._fuser([modules[j] for j in run], run[0])))
        if not compiling:
            # traced: no side effect, which Dynamo would replay (a new fuser) on every call
            ids = tuple([id(module) for module in modules])
            self.__dict__["_groups"] = (modules, ids, groups)
            # what a compiled call reads instead (fewer guards than the groups' structure)
            single = groups[0][1] if len(groups) == 1 else None
            self.__dict__["_route"] = None if single is None else (ids, single)
        return groups

    def _fuser(self, ops: list[BasicOperation], first_index: int) -> OperationFuser:
        return OperationFuser(ops, first_index=first_index, recipe=self.recipe)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_groups"] = state["_route"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # a copy (copy.deepcopy, pickle) gets its own fusers now: its first compiled call
        # then takes the one-node fast path, as the original's does after an eager call
        if state.get("_groups") is None and "_modules" in state:
            self._get_groups()

    # ------------------------------------------------------------ op_kwargs
    def _resolve_op_kwargs(self, op_kwargs: Mapping[Any, Any] | None) -> dict[int, dict[str, Any]]:
        if op_kwargs is None:
            return {}
        if not isinstance(op_kwargs, Mapping):
            raise TypeError(
                f"Sequential: op_kwargs must be a mapping of op -> dict, got {type(op_kwargs).__name__}"
            )
        modules = self._module_list()
        resolved: dict[int, dict[str, Any]] = {}
        given_as: dict[int, str] = {}
        for key, value in op_kwargs.items():
            if isinstance(key, torch.nn.Module):
                positions = [i for i, m in enumerate(modules) if m is key]
                if not positions:
                    raise ValueError(
                        f"Sequential: op_kwargs key {type(key).__name__} is not a module of this Sequential"
                    )
                if len(positions) > 1:
                    raise ValueError(
                        f"Sequential: op_kwargs key {type(key).__name__} appears at indices {positions}; "
                        "give the index instead"
                    )
                index, label = positions[0], f"module {type(key).__name__}"
            elif isinstance(key, int) and not isinstance(key, bool):
                n = len(modules)
                if not -n <= key < n:
                    raise ValueError(
                        f"Sequential: op_kwargs key {key} is out of range for a Sequential of {n} modules"
                    )
                index, label = key % n, f"index {key}"
            else:
                raise ValueError(
                    f"Sequential: op_kwargs key {key!r} must be a module of this Sequential or an int index"
                )
            module = modules[index]
            if not isinstance(module, BasicOperation):
                raise ValueError(
                    f"Sequential: op_kwargs key {label} names {type(module).__name__} at index {index}, "
                    "which is not a fusible op and takes no kwargs"
                )
            if index in resolved:
                raise ValueError(
                    f"Sequential: op_kwargs gives op {index} ({module.op_name()}) twice, "
                    f"as {given_as[index]} and as {label}"
                )
            if not isinstance(value, Mapping):
                raise TypeError(
                    f"Sequential: op_kwargs value for {label} must be a mapping of kwargs, got {type(value).__name__}"
                )
            module.check_kwargs(dict(value))
            resolved[index] = dict(value)
            given_as[index] = label
        return resolved

    def _split_extra_inputs(self, extra_inputs: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        groups = self._get_groups()
        counts = [sum(op.num_extra_inputs for op in fuser.ops) if fuser else 0 for _, fuser in groups]
        if len(extra_inputs) != sum(counts):
            takers = [
                f"{i}:{m.op_name()} takes {m.num_extra_inputs}"
                for i, m in enumerate(self._module_list())
                if isinstance(m, BasicOperation) and m.num_extra_inputs
            ]
            raise ValueError(
                f"Sequential: expected {sum(counts)} extra input(s) ({', '.join(takers) or 'no op takes any'}), "
                f"got {len(extra_inputs)}"
            )
        result, start = [], 0
        for count in counts:
            result.append(tuple(extra_inputs[start : start + count]))
            start += count
        return result

    def _check_buffers(
        self, input: torch.Tensor, extra_inputs: tuple[Any, ...], kwargs_by_index: dict[int, dict[str, Any]]
    ) -> None:
        """Once per call, for the whole Sequential: no caller buffer overlaps another buffer
        of the call, the input, an extra input, or any parameter or module buffer."""
        if not kwargs_by_index:
            return
        modules = self._module_list()
        indices = sorted(kwargs_by_index)
        buffers = call_buffers(
            [modules[i] for i in indices],
            [kwargs_by_index[i] for i in indices],
            indices,
        )
        if buffers:
            check_call_buffers(buffers, [input, *extra_inputs, *self.parameters(), *self.buffers()])

    # ------------------------------------------------------------ running
    def forward(self, input: torch.Tensor, *extra_inputs: Any, op_kwargs: Mapping[Any, Any] | None = None):
        """Run the modules in order; each run of basic ops goes through its fuser.

        Args:
            input: the main tensor, ``[*, in]`` (e.g. ``[N, hidden]`` routed rows for an expert
                block).
            *extra_inputs: the extra inputs of every op that declares some, in op order (e.g.
                split sizes ``[E]``, routing probabilities ``[N]``, split sizes again for the
                expert block ``GroupedLinear -> ScaledSwiGLU -> GroupedLinear``).
            op_kwargs: per-op keyword arguments: ``{op or index: {key: value}}``, e.g.
                ``{fo.OUTPUT_BUFFER_KEY: buffer}`` for a caller-provided output.

        Returns:
            The last module's output, ``[*, out]``; ``(output, *extra_outputs)`` when ops
            produce extra outputs.

        Raises:
            ValueError: a call that an op refuses (shapes, dtypes, devices, split sizes,
                overlapping buffers), a wrong number of extra inputs, or an ``op_kwargs``
                key that names no fusible op of this Sequential; raised before anything is
                computed or written.
            TypeError: ``op_kwargs`` (or one of its values) that is not a mapping, or a
                kwarg that its op does not accept.
        """
        if op_kwargs is None:
            compiling = is_compiling()
            if compiling:
                # one fuser group of the current modules (their ids, read once: one path
                # to each op for Dynamo to guard): the in-graph call, if it applies
                route = self.__dict__.get("_route")
                if route is not None and len(extra_inputs) == route[1].num_extra_inputs:
                    ops = tuple(self._modules.values())
                    if route[0] == tuple([id(op) for op in ops]):
                        result = compiled_call(route[1], ops, input, extra_inputs, None)
                        if result is not None:
                            return result
            groups = self._get_groups(compiling)
            fuser = groups[0][1] if len(groups) == 1 else None
            if fuser is not None and len(extra_inputs) == fuser.num_extra_inputs:
                if not compiling and isinstance(input, torch.Tensor):  # (traced: no guard on it)
                    # see fuser.fast_path: its guards hold, or it answers None
                    fast = fuser._fast_index.get((input.shape, torch.is_grad_enabled()))
                    if fast is not None:
                        result = fast(fuser, input, extra_inputs)
                        if result is not None:
                            return result
                return fuser(input, *extra_inputs)  # one fuser group, nothing to route
        kwargs_by_index = self._resolve_op_kwargs(op_kwargs)
        per_group_extra = self._split_extra_inputs(extra_inputs)
        self._check_buffers(input, extra_inputs, kwargs_by_index)
        x = input
        extra_outputs: list[torch.Tensor] = []
        for (indices, fuser), group_extra in zip(self._get_groups(), per_group_extra):
            if fuser is None:
                x = self._modules[str(indices[0])](x)
                continue
            group_kwargs = [kwargs_by_index.get(i) for i in indices] if kwargs_by_index else None
            result = fuser(x, *group_extra, basic_op_kwargs=group_kwargs)
            if isinstance(result, tuple):
                x, *outs = result
                extra_outputs.extend(outs)
            else:
                x = result
        if extra_outputs:
            return (x, *extra_outputs)
        return x

    @property
    def last_plan(self) -> SequentialPlan | None:
        """Plans used by the most recent call (what actually ran)."""
        groups = self._get_groups()
        plans: list[FusionPlan | str] = []
        for indices, fuser in groups:
            if fuser is None:
                plans.append(type(self._modules[str(indices[0])]).__name__)
            elif fuser.last_plan is None:
                return None
            else:
                plans.append(fuser.last_plan)
        return SequentialPlan(plans)

    def explain(
        self, input: torch.Tensor, *extra_inputs: Any, op_kwargs: Mapping[Any, Any] | None = None
    ) -> SequentialPlan:
        """The fusion plan a call with these arguments would use, computing nothing.

        Validates the call like ``forward`` does. A plain module between fusible
        groups is assumed to keep the shape, dtype and device of its input.

        Args:
            input: the main tensor, as for :meth:`forward`.
            *extra_inputs: the extra inputs, as for :meth:`forward`.
            op_kwargs: per-op keyword arguments, as for :meth:`forward`.

        Returns:
            A :class:`~fusible_ops.SequentialPlan`: per group, its
            :class:`~fusible_ops.FusionPlan` (or the plain module's class name).

        Raises:
            ValueError, TypeError: as :meth:`forward` would for the same call.
        """
        kwargs_by_index = self._resolve_op_kwargs(op_kwargs)
        per_group_extra = self._split_extra_inputs(extra_inputs)
        self._check_buffers(input, extra_inputs, kwargs_by_index)
        meta = TensorMeta(tuple(input.shape), input.dtype, input.device)
        guard = [input, *(t for t in extra_inputs if isinstance(t, torch.Tensor)), *self.parameters()]
        upstream_grad = input.requires_grad
        plans: list[FusionPlan | str] = []
        for (indices, fuser), group_extra in zip(self._get_groups(), per_group_extra):
            if fuser is None:
                module = self._modules[str(indices[0])]
                plans.append(type(module).__name__)
                upstream_grad = upstream_grad or any(p.requires_grad for p in module.parameters())
                continue
            plan, meta = fuser.explain(
                meta, upstream_grad, group_extra, [kwargs_by_index.get(i) for i in indices], guard=guard
            )
            upstream_grad = upstream_grad or plan.requires_grad
            plans.append(plan)
        return SequentialPlan(plans)

    def extra_repr(self) -> str:
        return "" if self.recipe is None else f"recipe={self.recipe!r}"
