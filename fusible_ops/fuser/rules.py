"""Fusion rules: plain functions over the op list, registered at run time.

A rule has the signature ``rule(entries, context) -> entries``: it receives the
current forward or backward op list (``PlanEntry`` items) and returns a new one.
:func:`window_rule` builds the common kind from a pattern of op types and a
``build`` function, so rules never hand-write sliding-window loops.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.op import BasicOperation, FusedOperation
from ..core.registry_versions import registries_changed
from ..core.settings import Settings
from .plan import FusionDecision, PlanEntry

RuleFn = Callable[[list[PlanEntry], "FusionContext"], list[PlanEntry]]
FUSION_KINDS = ("forward", "backward", "joint")

_RULES: dict[str, list[RuleFn]] = {kind: [] for kind in FUSION_KINDS}
_registry_version = [0]
#: whether every registered rule is one of the library's (a user's rule may read any op state)
_library_rules_only = [True]


def _registry_changed() -> None:
    _registry_version[0] += 1
    _library_rules_only[0] = all(
        (getattr(rule, "__module__", None) or "").startswith("fusible_ops.")
        for rules in _RULES.values()
        for rule in rules
    )
    registries_changed(user_rules=not _library_rules_only[0])


def register_fusion(rule: RuleFn, *, kind: str, prepend: bool = False) -> RuleFn:
    """Register ``rule`` of ``kind`` ("forward", "backward" or "joint").

    The kind is a promise about the fused ops the rule builds (see
    :class:`~fusible_ops.core.op.FusedOperation`): a forward fusion fills the basic ops'
    contexts as their forwards would, a backward fusion reads them as their backwards
    would, a joint one replaces both; results equal the unfused ops'. Every plan a rule
    returns must cover each basic op once, in order (checked). ``prepend=True`` runs it
    before the rules already registered. Plans made before registration are discarded
    (the fuser re-plans).

    Args:
        rule: a callable ``rule(entries, context) -> entries`` over the plan's entries
            and a :class:`~fusible_ops.FusionContext`, e.g. from
            :func:`~fusible_ops.window_rule`. Registering it again moves it.
        kind: ``"forward"``, ``"backward"`` or ``"joint"``.
        prepend: run it before the rules already registered of its kind. Default: False.

    Returns:
        ``rule`` itself (so that it can decorate a function).

    Raises:
        ValueError: ``kind`` is not one of the three.
        TypeError: ``rule`` is not callable.
    """
    if kind not in FUSION_KINDS:
        raise ValueError(f"register_fusion: kind must be one of {FUSION_KINDS}, got {kind!r}")
    if not callable(rule):
        raise TypeError(
            f"register_fusion: rule must be a callable rule(entries, context) -> entries (e.g. from "
            f"window_rule), got {type(rule).__name__}"
        )
    rules = _RULES[kind]
    if rule in rules:
        rules.remove(rule)
    if prepend:
        rules.insert(0, rule)
    else:
        rules.append(rule)
    _registry_changed()
    return rule


def unregister_fusion(rule: RuleFn) -> None:
    """Remove ``rule`` from every kind it is registered under (a no-op if it is not).

    Plans made while it was registered are discarded (the fuser re-plans).

    Args:
        rule: the callable given to :func:`~fusible_ops.register_fusion`.
    """
    for rules in _RULES.values():
        if rule in rules:
            rules.remove(rule)
    _registry_changed()


#: modules whose import registers the library's own rules (a registry filled by name, so the
#: fuser never imports the fused ops it is built below)
BUILTIN_RULE_MODULES = ("fusible_ops.fused",)
_builtin_rules_loaded = [False]


def load_builtin_rules() -> None:
    """Import :data:`BUILTIN_RULE_MODULES` once, so that a fuser reached through any module
    (``import fusible_ops`` itself loads nothing) plans with the built-in fusions."""
    if not _builtin_rules_loaded[0]:
        for module in BUILTIN_RULE_MODULES:
            importlib.import_module(module)
        _builtin_rules_loaded[0] = True


def registered_rules(kind: str) -> list[RuleFn]:
    """The rules of ``kind``, in the order they run."""
    load_builtin_rules()
    return list(_RULES[kind])


def registry_version() -> int:
    """A counter bumped by every registration change (plans are cached per version)."""
    return _registry_version[0]


def registry_state() -> tuple[int, bool]:
    """``(registry version, whether every registered rule is the library's own)``."""
    return _registry_version[0], _library_rules_only[0]


@dataclass
class FusionContext:
    """What a rule may look at when deciding to fuse, plus the decision log."""

    ops: tuple[BasicOperation, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    settings: Settings
    kwarg_keys: tuple[frozenset[str], ...]
    #: an id per op and extra input, shared by extra inputs known to be equal
    extra_input_classes: tuple[tuple[int, ...], ...]
    #: a short description per op and extra input ("list", "cpu tensor", "cuda tensor", ...)
    extra_input_kinds: tuple[tuple[str, ...], ...]
    kind: str = ""
    decisions: list[FusionDecision] | None = None

    def has_kwarg(self, op_index: int, key: str) -> bool:
        """Whether op ``op_index`` (position in the group) got ``key`` in ``op_kwargs``."""
        return key in self.kwarg_keys[op_index]

    def same_extra_input(self, a: tuple[int, int], b: tuple[int, int]) -> bool:
        """Whether extra input ``a = (op_index, position)`` equals ``b`` (known cheaply)."""
        return self.extra_input_classes[a[0]][a[1]] == self.extra_input_classes[b[0]][b[1]]

    def record(
        self, rule: str, indices: Sequence[int], *, fired: bool, reason: str = "", backend=None
    ) -> None:
        """Log a decision for the plan.

        Args:
            rule: the rule's name.
            indices: the ops (positions in the group) the decision is about.
            fired: whether the fusion was applied.
            reason: why it was declined (empty when it fired).
            backend: the backend the fused op will use (a ``BackendChoice``), if any.
        """
        assert self.decisions is not None
        self.decisions.append(
            FusionDecision(rule, self.kind, tuple(indices), fired, reason=reason, backend=backend)
        )


#: ``build(context, ops, first_index)`` returns the fused op, or a string: the reason to decline
BuildFn = Callable[[FusionContext, list[BasicOperation], int], "FusedOperation | str"]


def window_rule(name: str, pattern: Sequence[type | tuple[type, ...]], build: BuildFn) -> RuleFn:
    """A rule that offers every window of unfused basic ops matching ``pattern`` to ``build``.

    Windows are scanned left to right; a fired window is consumed. Every window that
    matched the pattern but was declined is logged with the reason ``build`` gave.
    ``pattern`` holds one basic-op class (or a tuple of them, any of which matches) per
    op of the window; a bad name, pattern or ``build`` raises here, naming the argument.

    Args:
        name: the rule's name, a non-empty str: the plan's decisions show it, and it
            becomes the rule's ``__name__``.
        pattern: a non-empty sequence with one entry per op of the window: a
            :class:`~fusible_ops.BasicOperation` subclass, or a tuple of them (any of
            which matches); ops match by ``isinstance``.
        build: ``build(context, ops, first_index)``: ``context`` the
            :class:`~fusible_ops.FusionContext`, ``ops`` the window's basic ops,
            ``first_index`` the first op's position in the group. It returns the
            :class:`~fusible_ops.FusedOperation` that replaces the window, or a
            non-empty str: the reason to decline, logged in the plan.

    Returns:
        The rule, ``rule(entries, context) -> entries``, to pass to
        :func:`~fusible_ops.register_fusion`.

    Raises:
        TypeError: ``name`` is not a non-empty str, ``pattern`` not a sequence of
            basic-op classes (or tuples of them), or ``build`` not callable; at run
            time, ``build`` returned neither a fused op nor a non-empty str.
        ValueError: ``pattern`` is empty.
    """
    pattern = _checked_pattern(name, pattern, build)

    def matches(window: list[PlanEntry]) -> bool:
        return len(window) == len(pattern) and all(
            isinstance(entry.op, BasicOperation) and isinstance(entry.op, types)
            for entry, types in zip(window, pattern)
        )

    def rule(entries: list[PlanEntry], context: FusionContext) -> list[PlanEntry]:
        result: list[PlanEntry] = []
        position = 0
        while position < len(entries):
            window = entries[position : position + len(pattern)]
            if matches(window):
                ops = [entry.op for entry in window]
                indices = tuple(i for entry in window for i in entry.indices)
                built: Any = build(context, ops, indices[0])
                if isinstance(built, FusedOperation):
                    context.record(name, indices, fired=True, reason=built.note, backend=built.backend)
                    result.append(PlanEntry(built, indices))
                    position += len(pattern)
                    continue
                if not isinstance(built, str) or not built:
                    raise TypeError(
                        f"fusion rule {name!r}: build returned {type(built).__name__}; it must return a "
                        "FusedOperation, or a non-empty str: the reason to decline"
                    )
                context.record(name, indices, fired=False, reason=built)
            result.append(entries[position])
            position += 1
        return result

    rule.__name__ = name
    rule.__qualname__ = name
    return rule


def _checked_pattern(name: Any, pattern: Any, build: Any) -> tuple[type | tuple[type, ...], ...]:
    """``pattern`` as a tuple, after checking ``window_rule``'s arguments (``TypeError``/``ValueError``)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"window_rule: name must be a non-empty str, got {name!r}")
    where = f"window_rule({name!r})"
    if isinstance(pattern, (str, bytes)) or not isinstance(pattern, Sequence):
        raise TypeError(
            f"{where}: pattern must be a sequence of basic-op classes (or tuples of them), "
            f"got {type(pattern).__name__}"
        )
    pattern = tuple(pattern)
    if not pattern:
        raise ValueError(f"{where}: pattern is empty; it needs one basic-op class (or tuple of them) per op")
    for position, types in enumerate(pattern):
        options = types if isinstance(types, tuple) else (types,)
        if not options or not all(isinstance(t, type) and issubclass(t, BasicOperation) for t in options):
            raise TypeError(
                f"{where}: pattern entry {position} is {types!r}; expected a BasicOperation subclass "
                "or a non-empty tuple of them (the window's op classes; nothing else can match)"
            )
    if not callable(build):
        raise TypeError(
            f"{where}: build must be callable as build(context, ops, first) -> FusedOperation | str, "
            f"got {type(build).__name__}"
        )
    return pattern


# ---------------------------------------------------------------- what plans are keyed on and checked against

_CHEAP_COMPARE_NUMEL = 4096


def compares_by_value(value: Any) -> bool:
    """Whether two such extra inputs count as equal when their values are (cheap to read)."""
    if isinstance(value, (list, tuple)):
        return all(isinstance(v, int) for v in value)
    return (
        isinstance(value, torch.Tensor)
        and value.is_cpu  # not value.device: this runs on every call
        and not value.is_floating_point()
        and value.dim() == 1
        and value.numel() <= _CHEAP_COMPARE_NUMEL
    )


def _extra_input_identity(value: Any, by_value: bool) -> tuple[tuple, str]:
    """A key under which equal extra inputs collide when equality is cheap to see.

    Integer lists and small integer CPU tensors compare by value; anything else (a
    device tensor, whose values would need a host sync) only by identity. While
    tracing (``by_value=False``) tensors compare by identity only: reading their
    values would be a host read in the graph.
    """
    if isinstance(value, (list, tuple)) and compares_by_value(value):
        return ("values", tuple(value)), "list"
    if isinstance(value, torch.Tensor):
        kind = f"{value.device.type} tensor"
        if by_value and compares_by_value(value):
            return ("values", tuple(value.tolist())), kind
        return ("object", value), kind
    return ("object", value), type(value).__name__


def classify_extra_inputs(
    extra_inputs: list[tuple[Any, ...]],
) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[str, ...], ...]]:
    by_value = not torch.compiler.is_compiling()
    seen: list[tuple] = []
    #: (object, its class, its kind) of each distinct object: a value given twice (the same
    #: split sizes to fc1 and fc2) is classified once
    objects: list[tuple[Any, int, str]] = []
    classes, kinds = [], []
    for op_inputs in extra_inputs:
        op_classes, op_kinds = [], []
        for value in op_inputs:
            known = next((entry for entry in objects if entry[0] is value), None)
            if known is None:
                identity, kind = _extra_input_identity(value, by_value)
                known = (value, _class_of(seen, identity), kind)
                objects.append(known)
            op_classes.append(known[1])
            op_kinds.append(known[2])
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


def checked_plan(rule, entries, ops: list[BasicOperation], kind: str) -> list[PlanEntry]:
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
