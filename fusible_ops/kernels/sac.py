"""Selective activation checkpointing policies that see the library's GEMMs as GEMMs.

A policy for ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` is usually
written against aten's matmuls (``aten.mm``, ``aten._grouped_mm``, ...). The library's
kernels run as ``fusible_ops::`` custom ops (one opaque op per kernel), which such a
policy never names, so it would recompute every expert GEMM. :func:`sac_policy` adapts
a policy or a save list so that each of these ops is treated like ``aten.mm``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

#: the library's forward ops that run GEMMs (a fused expert block is one op with two)
FUSIBLE_GEMM_OP_NAMES = ("grouped_fprop", "grouped_mlp_forward")


def fusible_gemm_ops() -> frozenset:
    """The ``torch.ops.fusible_ops`` overloads of :data:`FUSIBLE_GEMM_OP_NAMES`."""
    from . import library  # noqa: F401  (defines the ops)

    return frozenset(getattr(torch.ops.fusible_ops, name).default for name in FUSIBLE_GEMM_OP_NAMES)


def _aten_gemms() -> frozenset:
    aten = torch.ops.aten
    return frozenset(
        getattr(aten, name).default
        for name in ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm")
        if hasattr(aten, name)
    )


def sac_policy(policy: Callable[..., Any] | Iterable[Any]) -> Callable[..., Any]:
    """A selective-checkpointing policy that treats the library's GEMM ops as ``aten.mm``.

    Args:
        policy: a policy function ``(ctx, func, *args, **kwargs) -> CheckpointPolicy``
            written for aten ops (it is called with ``torch.ops.aten.mm.default`` in place
            of a library GEMM op, e.g. torchtitan's "save every other mm" counts them), or
            a save list of op overloads: those ops are saved (``MUST_SAVE``) and everything
            else recomputed (``PREFER_RECOMPUTE``); the library's GEMMs are saved when the
            list holds any aten GEMM (``mm``, ``addmm``, ``bmm``, ``_grouped_mm``, ...).

    Returns:
        A policy function for ``create_selective_checkpoint_contexts``.

    Raises:
        TypeError: ``policy`` is neither callable nor an iterable of op overloads.
    """
    from torch.utils.checkpoint import CheckpointPolicy

    ours = fusible_gemm_ops()
    if callable(policy):
        inner = policy

        def adapted(ctx, func, *args, **kwargs):  # noqa: ANN001, ANN202
            return inner(ctx, torch.ops.aten.mm.default if func in ours else func, *args, **kwargs)

        return adapted
    try:
        save = frozenset(policy)
    except TypeError:
        raise TypeError(
            f"sac_policy: policy must be a policy function or an iterable of op overloads, got {policy!r}"
        ) from None
    bad = [op for op in save if not isinstance(op, torch._ops.OpOverload)]
    if bad:
        raise TypeError(
            f"sac_policy: the save list must hold op overloads (e.g. torch.ops.aten.mm.default), got {bad!r}"
        )
    if save & _aten_gemms():
        save |= ours

    def from_list(ctx, func, *args, **kwargs):  # noqa: ANN001, ANN202
        return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE

    return from_list
