"""Activation-checkpointing recomputation under the recipe its forward ran with.

A recipe given by the thread-local ``fusible_ops.quantized`` context is read when a fuser
runs. An activation-checkpointing recomputation runs the forward again during backward,
possibly outside the ``with`` block: it would compute unquantized what the forward
quantized (torch then fails on the saved-tensor count, or, when the counts happen to
agree, the gradients are silently wrong). So a fuser without a recipe of its own records
which context recipe each differentiable forward ran under, for as long as that
forward's autograd graph lives; a recomputation then runs under that recipe, and refuses,
naming the choice, when live forwards ran under different recipes.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from ..core.settings import current_settings, settings

if TYPE_CHECKING:
    from .operation_fuser import OperationFuser

_INSIDE = threading.local()


def inside_tracked_call() -> bool:
    """Whether this thread is already in :func:`call_tracking_recipe` (no second wrap)."""
    return getattr(_INSIDE, "active", False)


def _first_tensor(result: Any) -> torch.Tensor | None:
    if isinstance(result, torch.Tensor):
        return result
    if isinstance(result, tuple) and result and isinstance(result[0], torch.Tensor):
        return result[0]
    return None


def _recipe_to_run(fuser: OperationFuser, live: dict) -> Any:
    """The recipe a recomputation runs under: the one every live forward of ``fuser`` used."""
    recipe = current_settings().recipe
    used = {r for r, count in live.items() if count > 0}
    if not used or used == {recipe}:
        return recipe
    if len(used) == 1:
        return next(iter(used))
    raise RuntimeError(
        f"{type(fuser).__name__}: an activation-checkpointing recomputation cannot tell which "
        f"low-precision recipe its forward ran under (live forwards used {sorted(map(repr, used))}); "
        "run backward inside the same fusible_ops.quantized block as the forward, or give the "
        "module its own recipe (Sequential(..., recipe=...), MoE(..., recipe=...))"
    )


def call_tracking_recipe(
    fuser: OperationFuser, input_: torch.Tensor, *extra_inputs: Any, **kwargs: Any
) -> Any:
    """``fuser(input_, *extra_inputs, **kwargs)``, recording (or, in a recomputation, restoring)
    the context recipe of a differentiable forward."""
    live = fuser.__dict__.setdefault("_live_forward_recipes", {})
    grad = torch.is_grad_enabled()
    recomputing = grad and torch._C._current_graph_task_id() != -1
    recipe = current_settings().recipe
    context = nullcontext()
    if recomputing:
        wanted = _recipe_to_run(fuser, live)
        if wanted is not recipe:
            context = settings(recipe=wanted)
    _INSIDE.active = True
    try:
        with context:
            result = fuser(input_, *extra_inputs, **kwargs)
    finally:
        _INSIDE.active = False
    out = _first_tensor(result)
    if grad and not recomputing and out is not None and out.grad_fn is not None:
        live[recipe] = live.get(recipe, 0) + 1
        try:  # the graph's lifetime: our autograd node (an ATen node, e.g. after a hook, takes no weakref)
            weakref.finalize(out.grad_fn, _forget, live, recipe)
        except TypeError:
            weakref.finalize(out, _forget, live, recipe)
    return result


def _forget(live: dict, recipe: Any) -> None:
    live[recipe] -= 1
