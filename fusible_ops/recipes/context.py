"""``fusible_ops.quantized(recipe)``: turn a low-precision recipe on for a block of code.

The recipe is a field of the thread-local :class:`~fusible_ops.settings.Settings`, so it
keys fusion plans like every setting, and a compiled call guards it with the settings:
entering a different recipe recompiles, the same one does not. A module's own recipe
(``fo.Sequential(..., recipe=...)``, ``fo.MoE(..., recipe=...)``) wins over the context.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from ..core.settings import Settings, current_settings, settings
from .recipes import Recipe


@contextlib.contextmanager
def quantized(recipe: Recipe | None, *, backend: str = "auto") -> Iterator[Settings]:
    """Run the GEMMs of every fusible op in the block under ``recipe`` (None: unquantized).

    Thread-local and nestable, like :func:`fusible_ops.settings` (it sets ``recipe`` and
    ``recipe_backend``). A module's own recipe (``fo.Sequential(..., recipe=...)``,
    ``fo.MoE(..., recipe=...)``) wins over it.

    >>> import fusible_ops as fo
    >>> with fo.quantized(fo.recipes.MXFP8()):
    ...     pass  # GroupedLinear, BasicLinear and GroupedMLP GEMMs run in MXFP8 here

    Args:
        recipe: a ``fusible_ops.recipes`` recipe (:class:`~fusible_ops.recipes.MXFP8`,
            :class:`~fusible_ops.recipes.Float8Tensorwise`, ...), or None to run unquantized.
        backend: how the quantized GEMMs run: ``"auto"`` (default; the device's best),
            ``"emulation"`` (quantize, then fp32 GEMMs on the dequantized values; any
            device), ``"scaled_mm"`` (``torch._scaled_mm`` per group; CPU, tensorwise
            and rowwise, eager) or ``"scaled_grouped_mm"``
            (``torch.nn.functional.scaled_grouped_mm``; CUDA).

    Returns:
        A context manager; ``with fo.quantized(...) as active`` binds ``active`` to the
        :class:`~fusible_ops.Settings` in force inside the block.

    Raises:
        TypeError: ``recipe`` is not a recipe.
        ValueError: ``backend`` is not one of the names above.
    """
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(
            f"fusible_ops.quantized: expected a fusible_ops.recipes recipe or None, got {recipe!r}"
        )
    with settings(recipe=recipe, recipe_backend=backend) as active:
        yield active


def current_recipe() -> Recipe | None:
    """The recipe in force on this thread.

    Returns:
        The recipe of the innermost :func:`~fusible_ops.quantized` (or
        ``fusible_ops.settings(recipe=...)``) block on this thread, or None outside one.
    """
    return current_settings().recipe


def check_recipe(owner: str, recipe: object) -> Recipe | None:
    """``recipe`` when it is a recipe or None, else ``TypeError`` naming ``owner``."""
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"{owner}: recipe must be a fusible_ops.recipes recipe or None, got {recipe!r}")
    return recipe
