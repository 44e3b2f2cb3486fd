"""Check a state dict against a module before ``load_state_dict`` copies anything.

``torch.nn.Module.load_state_dict`` copies key by key and raises only at the end, so a
state dict with one wrong shape or one missing key leaves the module half loaded.
:func:`check_state_dict` runs the same load as a dry run first: a failed load then
changes nothing.
"""

from __future__ import annotations

import sys
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_MISSING = object()


def check_state_dict(
    module: nn.Module, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
) -> None:
    """Raise what ``module.load_state_dict(state_dict, strict, assign)`` would raise, before
    anything is copied.

    A dry run of torch's own load, so everything that shapes a load applies as it will:
    load-state-dict pre-hooks, ``_load_from_state_dict`` overrides (e.g. ``GroupedLinear``'s
    per-group keys), DTensor parameters, ``strict`` and the state dict's ``_metadata``. Each
    copy into a parameter or buffer is checked instead of made; ``set_extra_state`` and
    load-state-dict post-hooks are not called (a post-hook that edits the incompatible keys
    is not consulted). Pre-hooks run, and run again in the real load: they must only rewrite
    the state dict or be idempotent, as torch's and FSDP's are.

    Beyond torch's checks (every key, a tensor per key, every shape), a copy (``assign=False``)
    that would fail or lose data is refused: between a DTensor and a plain tensor, out of a
    meta tensor, between layouts (a sparse value), complex into real.

    Raises:
        TypeError: ``state_dict`` is not a mapping.
        RuntimeError: torch's ``"Error(s) in loading state_dict for <class>: ..."``.
    """
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"Expected state_dict to be dict-like, got {type(state_dict)}.")
    modules = list(module.modules())
    saved = [
        (m.__dict__["_load_state_dict_post_hooks"], m.__dict__.get("set_extra_state", _MISSING))
        for m in modules
    ]
    swap = torch.__future__.get_swap_module_params_on_conversion()
    try:
        for m in modules:
            m.__dict__["_load_state_dict_post_hooks"] = OrderedDict()
            if type(m).set_extra_state is not nn.Module.set_extra_state:
                m.__dict__["set_extra_state"] = _ignore_extra_state
        # swapping would exchange the real parameters for the dry run's results
        torch.__future__.set_swap_module_params_on_conversion(False)
        with warnings.catch_warnings(), _CheckedCopies(check=not assign):
            warnings.simplefilter("ignore")  # the real load warns again
            nn.Module.load_state_dict(module, state_dict, strict=strict, assign=False)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
        for m, (post_hooks, extra) in zip(modules, saved):
            m.__dict__["_load_state_dict_post_hooks"] = post_hooks
            if extra is _MISSING:
                m.__dict__.pop("set_extra_state", None)
            else:
                m.__dict__["set_extra_state"] = extra


def _ignore_extra_state(state: Any) -> None:
    """Stands in for ``set_extra_state`` during the dry run."""


class _CheckedCopies(TorchFunctionMode):
    """Turns ``Tensor.copy_`` into a check (``check``) or a no-op: nothing is written."""

    def __init__(self, check: bool) -> None:
        super().__init__()
        self.check = check

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is torch.Tensor.copy_:
            dest = args[0]
            if self.check:
                _check_copy(dest, args[1] if len(args) > 1 else (kwargs or {})["src"])
            return dest
        return func(*args, **(kwargs or {}))


def _check_copy(dest: torch.Tensor, src: torch.Tensor) -> None:
    """``RuntimeError`` if ``dest.copy_(src)`` would fail or lose data."""
    if _is_dtensor(dest) != _is_dtensor(src):
        kinds = ("a DTensor", "a plain tensor") if _is_dtensor(src) else ("a plain tensor", "a DTensor")
        raise RuntimeError(f"cannot copy {kinds[0]} into {kinds[1]} (mixed torch.Tensor and DTensor)")
    if src.is_meta and not dest.is_meta:
        raise RuntimeError("cannot copy out of a meta tensor (it holds no data)")
    if src.layout != dest.layout:
        raise RuntimeError(f"cannot copy a {src.layout} tensor into a {dest.layout} one")
    if src.is_complex() and not dest.is_complex():
        raise RuntimeError(f"copying {src.dtype} into {dest.dtype} would discard the imaginary part")


def _is_dtensor(tensor: torch.Tensor) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")  # no DTensor exists before it is imported
    return dtensor is not None and isinstance(tensor, dtensor.DTensor)


class CheckedLoadStateDict:
    """A module mixin: ``load_state_dict`` checks first (:func:`check_state_dict`), so a load
    that fails changes nothing. (A parent module's ``load_state_dict`` reaches this module
    through torch's recursion, without the check.)"""

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):  # noqa: ANN201
        """As ``nn.Module.load_state_dict``, but a load that fails changes nothing: a dry run of
        the same load first checks every key, value and shape (per-group ``weight{i}`` keys
        and DTensor parameters included)."""
        check_state_dict(self, state_dict, strict, assign)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)
