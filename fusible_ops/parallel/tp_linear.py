"""Alias of :mod:`fusible_ops.basic.linear_dispatch` (the TP-safe linear dispatch lives with
the basic ops that use it, so ``basic`` imports nothing from ``parallel``)."""

import sys

from ..basic import linear_dispatch as _dispatch

sys.modules[__name__] = _dispatch
