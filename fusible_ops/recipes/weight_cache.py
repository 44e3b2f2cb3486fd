"""Quantized copies of weights, cached per parameter while the parameter is unchanged.

A copy is keyed on the parameter tensor (by identity, held weakly), its version counter
and its data pointer, plus the recipe, the contraction direction and the compute dtype.
An optimizer step or ``load_state_dict`` (in-place writes bump the version), ``p.data =``
(a new data pointer) or a parameter swap (another tensor) makes the next call quantize
afresh: a stale copy is never used. Micro-batches between two optimizer steps reuse it.
FSDP2's unsharded parameters are written without a version bump, so they are never
cached (quantized afresh on every call); nor are DTensor (tensor-parallel) parameters,
whose rank-local shards are quantized afresh on every call.
While tracing (``torch.compile``) or under a dispatch mode the copy is made in the graph.
"""

from __future__ import annotations

import sys

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .quantize import QuantizedOperand, quantize_weight
from .recipes import Recipe

_CACHE: WeakIdKeyDictionary = WeakIdKeyDictionary()
#: cache lookups since the last :func:`clear_weight_cache`: ``{"hits": n, "misses": n}``
STATS = {"hits": 0, "misses": 0}


def _cacheable() -> bool:
    return not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0


def _is_fsdp_unsharded(param: torch.Tensor) -> bool:
    """Whether ``param`` is one of FSDP2's unsharded parameters. FSDP2 all-gathers into them
    without bumping their version counter (and often into the same memory), so a copy keyed
    on version and address could be stale after an optimizer step: they are quantized afresh
    every call. FSDP2 keeps one unsharded parameter object per parameter, so the ids found
    are remembered; the states are scanned again only for a parameter not among them."""
    states = sys.modules.get("torch.distributed._composable_state")
    mapping = getattr(states, "_module_state_mapping", None)
    if not mapping:
        return False
    if id(param) in _FSDP_UNSHARDED_IDS:
        return True
    _FSDP_UNSHARDED_IDS.clear()
    for ref in list(mapping.values()):
        state = ref() if callable(ref) else ref
        group = getattr(state, "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()):
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            if unsharded is not None:
                _FSDP_UNSHARDED_IDS.add(id(unsharded))
    return id(param) in _FSDP_UNSHARDED_IDS


#: ids of the FSDP2 unsharded parameters last found (see :func:`_is_fsdp_unsharded`)
_FSDP_UNSHARDED_IDS: set[int] = set()


def quantized_weight(
    param: torch.Tensor, weight: torch.Tensor, recipe: Recipe, along: str
) -> QuantizedOperand:
    """``weight`` (``[G, N, K]`` or ``[N, K]``, computed from ``param`` by views and casts)
    quantized for contraction ``along`` its columns or rows, from the cache when
    ``param`` has not changed since the copy was made.

    Args:
        param: the parameter the cache entry is keyed on (held weakly).
        weight: the tensor to quantize, ``[G, N, K]`` or ``[N, K]``: ``param`` itself, or
            a view or cast of it.
        recipe: the recipe that gives the tiles and the FP8 format.
        along: ``ALONG_COLUMNS`` or ``ALONG_ROWS``, the contraction direction.

    Returns:
        The :class:`~fusible_ops.recipes.QuantizedOperand`, as
        :func:`~fusible_ops.recipes.quantize_weight` makes it.
    """
    if not _cacheable() or _is_fsdp_unsharded(param) or type(param).__name__ == "DTensor":
        return quantize_weight(weight, recipe, along)
    key = (recipe, along, weight.dtype, tuple(weight.shape), tuple(weight.stride()))
    state = (param._version, param.data_ptr(), param.storage_offset())
    entries = _CACHE.get(param)
    if entries is not None:
        found = entries.get(key)
        if found is not None and found[0] == state:
            STATS["hits"] += 1
            return found[1]
    else:
        entries = {}
        _CACHE[param] = entries
    STATS["misses"] += 1
    with torch.no_grad():
        operand = quantize_weight(weight.detach(), recipe, along)
    entries[key] = (state, operand)
    return operand


def clear_weight_cache() -> None:
    """Drop every cached copy and reset :data:`STATS`."""
    _CACHE.clear()
    STATS["hits"] = STATS["misses"] = 0
