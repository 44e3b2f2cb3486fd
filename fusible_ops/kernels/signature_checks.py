"""Backend argument checks once per call signature, not on every call.

The public backend methods check their arguments (:mod:`.grouped_checks`) before any
work. A fuser call whose signature was seen before (the shapes, dtypes and devices of
every input and parameter, see :mod:`fusible_ops.fuser.signature`), and whose first call
passed every one of those checks, hands the kernels arguments with that same metadata,
and split sizes whose values the ops checked for this call (non-negative, one per group,
summing to the rows). While such a call runs, :func:`arguments_checked` is True and the
public methods skip the checks that depend only on metadata; everything else they do
(zero-row calls, host split sizes) is unchanged. The fuser also skips its checks of the
ops' results (:mod:`fusible_ops.core.contract`), which have the same structure and shapes.

Only plans made entirely of the library's own ops take part (:func:`signature_fixes_kernel_args`,
matched by exact type): their kernel arguments follow from the signature, and they run
no user code. A user's op may compute kernel arguments from values, so its plans check
every call. Tracing never sets the flag.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

_TRUSTED: set[type] = set()


class _State(threading.local):
    on = False


_STATE = _State()


def signature_fixes_kernel_args(cls: type) -> type:
    """Class decorator for the library's ops: every backend call they make takes arguments
    fixed by the call signature (and split values their ``check_values`` checks)."""
    _TRUSTED.add(cls)
    return cls


def is_library_op(op: Any) -> bool:
    """Whether ``op`` is exactly one of those ops (not a subclass)."""
    return type(op) in _TRUSTED


def plan_takes_part(plan: Any) -> bool:
    """Whether every entry of ``plan`` (forward and backward) is one of those ops, exactly."""
    return all([is_library_op(entry.op) for entry in (*plan.forward, *plan.backward)])


def arguments_checked() -> bool:
    """Whether the running call's backend arguments passed every check at its signature's first call."""
    return _STATE.on


class SignatureChecks:
    """Per prepared call signature: whether its forward's and its backward's backend calls
    have passed every check once (set only after a call that ran them succeeded)."""

    __slots__ = ("takes_part", "forward", "backward")

    def __init__(self, takes_part: bool) -> None:
        self.takes_part = takes_part
        self.forward = False
        self.backward = False


def run_with_arguments_checked(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with :func:`arguments_checked` True for this thread, restored after."""
    previous = _STATE.on
    _STATE.on = True
    try:
        return fn(*args, **kwargs)
    finally:
        _STATE.on = previous
