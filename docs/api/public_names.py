"""The public names the API reference documents, and the check that each has a docstring.

Shared by ``docs/api/conf.py`` (a warning, so ``sphinx -W`` fails) and
``tests/test_docs_build.py`` (an assertion), so both hold the same rule.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator

#: the modules the reference lists, with their public names; None: the module's ``__all__``
ENTRY_POINTS: dict[str, tuple[str, ...] | None] = {
    "fusible_ops": None,
    "fusible_ops.moe": (
        "topk_route",
        "permute",
        "unpermute",
        "Permutation",
        "ExpertPlacement",
        "expert_shard_placement",
    ),
    "fusible_ops.checkpoint": (
        "load_stacked",
        "export_stacked",
        "load_per_expert",
        "export_per_expert",
        "load_per_expert_state_dict",
        "load_grouped_keys",
        "export_grouped_keys",
        "expert_range",
    ),
    "fusible_ops.parallel": None,
    "fusible_ops.kernels": None,
    "fusible_ops.integrations.transformers": (
        "register",
        "prepare",
        "from_hf_experts",
        "to_hf_experts",
        "unsupported_reason",
        "cached_ops",
        "experts_forward",
    ),
}

#: ``nn.Module`` hooks a subclass overrides without changing what they mean
MODULE_HOOKS = frozenset({"extra_repr"})


def module_names(module_name: str) -> list[str]:
    """The public names of ``module_name``: those listed above, else its ``__all__``."""
    names = ENTRY_POINTS.get(module_name)
    return list(names if names is not None else importlib.import_module(module_name).__all__)


def is_own_module(module_name: str) -> bool:
    """Whether ``module_name`` is fusible-ops itself or one of its modules."""
    return module_name == "fusible_ops" or module_name.startswith("fusible_ops.")


def own_doc(cls: type, attribute: str) -> str | None:
    """The docstring of ``cls.attribute`` from the first fusible-ops class in the MRO that has
    one: an override inherits its base's contract, but never ``torch.nn.Module``'s text."""
    for klass in cls.__mro__:
        if not is_own_module(klass.__module__) or attribute not in vars(klass):
            continue
        value = vars(klass)[attribute]
        value = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
        doc = getattr(value, "__doc__", None)
        if doc and doc.strip():
            return doc
    return None


def public_members(cls: type) -> Iterator[str]:
    """Public methods and properties ``cls`` defines itself (inherited ones are listed on
    their base)."""
    for attribute, value in vars(cls).items():
        if attribute.startswith("_") or attribute in MODULE_HOOKS:
            continue
        if isinstance(value, (property, staticmethod, classmethod)) or inspect.isfunction(value):
            yield attribute


def missing_docstrings(module_name: str) -> list[str]:
    """``module.name`` and ``module.Class.member`` of every public name without a docstring."""
    module = importlib.import_module(module_name)
    missing = []
    for name in module_names(module_name):
        obj = getattr(module, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue  # constants are documented by the page that lists them
        if not (obj.__doc__ or "").strip():
            missing.append(f"{module_name}.{name}")
        if inspect.isclass(obj):
            missing.extend(
                f"{module_name}.{name}.{member}"
                for member in public_members(obj)
                if own_doc(obj, member) is None
            )
    return missing
