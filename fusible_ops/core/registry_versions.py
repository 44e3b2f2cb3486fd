"""One number for the state of the library's registries, for compiled calls to guard on.

A compiled call of the library's own ops depends on the fusion rules and the kernel
backends registered (:mod:`fusible_ops.fuser.compiled`). Both registries report every
change here; :data:`COMPILED_CALLS_KEY` then holds a fresh number, or -1 while a rule
that is not the library's own is registered (such calls are traced through). One int is
one guard per compiled call, where a version per registry and a flag were seven.
"""

from __future__ import annotations

import itertools
import threading

#: ``[key]``: a fresh int after every change to either registry; -1 while a user's fusion
#: rule is registered. Changed in place, so ``from ... import COMPILED_CALLS_KEY`` sees it.
COMPILED_CALLS_KEY = [0]

_NEXT = itertools.count(1)
_LOCK = threading.Lock()
_user_rules = [False]


def registries_changed(*, user_rules: bool | None = None) -> None:
    """Give :data:`COMPILED_CALLS_KEY` a fresh value; ``user_rules``: whether the fusion-rule
    registry now holds a rule that is not the library's (None: unchanged)."""
    with _LOCK:
        if user_rules is not None:
            _user_rules[0] = user_rules
        COMPILED_CALLS_KEY[0] = -1 if _user_rules[0] else next(_NEXT)
