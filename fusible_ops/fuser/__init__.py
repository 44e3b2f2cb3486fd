"""The operation fuser: plans runs of basic ops, swaps in fused ops, and runs them.

Owns :class:`OperationFuser` and its ``torch.autograd.Function``, module-hook handling,
compiled calls, call signatures, fusion rules and the plans that explain them, and
:class:`Sequential`. It may import ``core`` and ``kernels`` (for their call checks), never
the ops built on it (``basic``, ``fused``) or anything above them.
"""

from __future__ import annotations

from typing import Any

import torch

from ..core.op import BasicOperation, set_direct_call_runner
from .operation_fuser import OperationFuser


def _run_alone(op: BasicOperation, input_: torch.Tensor, extra_inputs: tuple, kwargs: dict) -> Any:
    # a fresh single-op fuser per call (planning one op is trivial) keeps the op free of a
    # reference cycle through a cached fuser
    fuser = OperationFuser([op], honour_hooks=False, keep_signatures=False)
    return fuser(input_, *extra_inputs, basic_op_kwargs=[kwargs])


set_direct_call_runner(_run_alone)

__all__ = ["OperationFuser"]
