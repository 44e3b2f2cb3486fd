"""Tensor-parallel-safe linear dispatch.

``tp_linear_forward`` picks one of three ways to compute ``x @ weight.T + bias``:

- ``"linear"``: :func:`torch.nn.functional.linear`, in eager mode (and, under
  ``torch.compile``, for ranks the matmul fallback does not cover, or for 2-D input when
  the caller asks for ``F.linear`` numerics);
- ``"async_tp"``: :func:`_async_tp_linear`, while ``torch.compile`` traces with Inductor's
  micro-pipeline TP pass enabled: the reshape -> mm -> reshape graph that pass fuses with
  the neighbouring all-gather / reduce-scatter;
- ``"bmm"`` / ``"mm"``: the DTensor-safe matmul fallback for every other compiled call
  and for 3-D DTensor inputs sharded on dim 0 or 1 (flattening ``[B, S]`` into one dim is
  a view DTensor cannot express when one of them is sharded).

Weights may be DTensors sharded colwise (``Shard(0)``) or rowwise (``Shard(1)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "PATH_ASYNC_TP",
    "PATH_BMM",
    "PATH_LINEAR",
    "PATH_MM",
    "select_tp_linear_path",
    "tp_linear_forward",
]

PATH_LINEAR = "linear"
PATH_ASYNC_TP = "async_tp"
PATH_BMM = "bmm"
PATH_MM = "mm"


def _is_async_tp_linear_enabled() -> bool:
    """True only while ``torch.compile`` traces with ``_micro_pipeline_tp`` set; False in eager."""
    if not torch.compiler.is_compiling():
        return False
    import torch._inductor.config as inductor_config

    return bool(inductor_config._micro_pipeline_tp)


def _async_tp_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Linear shaped for Inductor's micro-pipeline TP pass.

    ``x``: ``[..., in_features]``; ``weight``: ``[out_features, in_features]``;
    ``bias``: ``[out_features]`` or None. Returns ``[..., out_features]``.

    ``F.linear`` without bias lowers to reshape -> mm -> reshape for N-D input, which the
    pass matches; a bias inside ``F.linear`` would turn the mm into an addmm it does not
    match, so the bias is added afterwards.
    """
    out = F.linear(x, weight)
    if bias is not None:
        out = out + bias
    return out


def _dtensor_sharded_dims(x: torch.Tensor) -> set[int]:
    """The tensor dims (normalised to ``>= 0``) that a DTensor ``x`` is sharded on; empty otherwise."""
    if not torch.distributed.is_available():
        return set()
    from torch.distributed.tensor import DTensor

    if not isinstance(x, DTensor):
        return set()
    dims = set()
    for placement in x.placements:
        if placement.is_shard():
            dims.add(placement.dim % x.ndim)
    return dims


def _needs_dtensor_safe_path(x: torch.Tensor) -> bool:
    """A 3-D DTensor sharded on dim 0 or 1 cannot be flattened to 2-D by a view."""
    return x.ndim == 3 and bool(_dtensor_sharded_dims(x) & {0, 1})


def select_tp_linear_path(x: torch.Tensor, mm_for_2d_compile: bool) -> str:
    """The path :func:`tp_linear_forward` takes for ``x``: one of the ``PATH_*`` names."""
    if not _needs_dtensor_safe_path(x):
        if _is_async_tp_linear_enabled():
            return PATH_ASYNC_TP
        if not torch.compiler.is_compiling():
            return PATH_LINEAR
    if x.ndim == 3:
        return PATH_BMM
    if x.ndim == 2 and mm_for_2d_compile:
        return PATH_MM
    return PATH_LINEAR


def _check_linear_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if weight.ndim != 2:
        raise ValueError(
            "tp_linear_forward: weight must be 2-D [out_features, in_features], "
            f"got shape {tuple(weight.shape)}"
        )
    if x.ndim < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"tp_linear_forward: input of shape {tuple(x.shape)} does not end in in_features="
            f"{weight.shape[1]} of weight {tuple(weight.shape)}"
        )
    if bias is not None and (bias.ndim != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(
            f"tp_linear_forward: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}"
        )


def _bmm_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``[B, S, in] @ [B, in, out]`` with the weight expanded (not copied) over the batch."""
    out = torch.bmm(x, weight.t().unsqueeze(0).expand(x.shape[0], -1, -1))
    if bias is not None:
        out = out + bias
    return out


def _mm_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``[N, in] @ [in, out]`` plus an explicit bias add."""
    out = torch.mm(x, weight.t())
    if bias is not None:
        out = out + bias
    return out


def tp_linear_forward(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mm_for_2d_compile: bool,
) -> torch.Tensor:
    """``x @ weight.T + bias`` through the path that is safe and fast for tensor parallelism.

    Args:
        x: ``[..., in_features]``, typically ``[B, S, in_features]`` or ``[N, in_features]``;
            may be a DTensor.
        weight: ``[out_features, in_features]``; may be a DTensor sharded colwise
            (``Shard(0)``) or rowwise (``Shard(1)``).
        bias: ``[out_features]`` or None.
        mm_for_2d_compile: for 2-D ``x`` compiled without async TP, use ``torch.mm`` plus
            an explicit bias add (True) or ``F.linear`` (False).

    Returns:
        ``[..., out_features]``.
    """
    _check_linear_args(x, weight, bias)
    path = select_tp_linear_path(x, mm_for_2d_compile)
    if path == PATH_ASYNC_TP:
        return _async_tp_linear(x, weight, bias)
    if path == PATH_BMM:
        return _bmm_linear(x, weight, bias)
    if path == PATH_MM:
        return _mm_linear(x, weight, bias)
    return F.linear(x, weight, bias)
