"""Runtime settings: a context manager, never environment variables read at import.

>>> import fusible_ops as fo
>>> with fo.settings(fusion=False):
...     pass  # everything in here runs unfused
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    """The active settings. Fusion plans are cached per settings value."""

    #: apply fusion rules at all
    fusion: bool = True
    #: the grouped-GEMM backend, "auto" or a name that ``python -m fusible_ops info`` lists
    backend: str = "auto"
    #: whether the Triton backend autotunes tile configurations (else it takes the first one)
    triton_autotune: bool = True
    #: low-precision recipe of ``fusible_ops.quantized`` (a ``fusible_ops.recipes.Recipe``), or None
    recipe: object = None
    #: how quantized GEMMs run, one of "auto", "emulation", "scaled_mm" (CPU) or "scaled_grouped_mm" (CUDA)
    recipe_backend: str = "auto"

    @property
    def facts(self) -> tuple:
        """Every setting, as a tuple (what a compiled call guards on)."""
        return (self.fusion, self.backend, self.triton_autotune, self.recipe, self.recipe_backend)


#: the type each setting must have exactly
_TYPES: dict[str, type] = {"fusion": bool, "backend": str, "triton_autotune": bool, "recipe_backend": str}


class _SettingsStack(threading.local):
    """Per thread: the settings stack, and a key of its top's :attr:`Settings.facts` (kept
    with every push and pop, so that a compiled call guards one int, not each field)."""

    def __init__(self) -> None:
        self.stack: list[Settings] = [Settings()]
        self.facts_key = _facts_key(self.stack[-1])

    def top_changed(self) -> None:
        self.facts_key = _facts_key(self.stack[-1])


_FACTS_KEYS: dict[tuple, int] = {}
_NEXT_KEY = itertools.count()


def _facts_key(settings: Settings) -> int:
    """An int per distinct :attr:`Settings.facts` (equal settings, equal key; ``next`` and
    ``setdefault`` are atomic, so two threads never give one key to different settings)."""
    key = _FACTS_KEYS.get(settings.facts)
    return _FACTS_KEYS.setdefault(settings.facts, next(_NEXT_KEY)) if key is None else key


_STATE = _SettingsStack()

#: whether a recipe was ever set through ``settings``/``fusible_ops.quantized`` in this
#: process: only then do fusers track which recipe each forward ran under
#: (``fusible_ops.fuser.recompute``)
RECIPE_CONTEXT_USED = [False]

# the kernel registry (a higher layer) installs the function that lists its backends
_backend_names: Callable[[], list[str]] = list


# the recipes package (a higher layer) installs its base class and engine names
_recipe_types: list = [(), ("auto",)]


def set_recipe_types(recipe_base: type, recipe_backends: tuple[str, ...]) -> None:
    """Install the recipe base class and the recipe engine names (the recipes package's)."""
    _recipe_types[:] = [recipe_base, recipe_backends]


def set_backend_names_provider(provider: Callable[[], list[str]]) -> None:
    """Install the function that lists the registered backend names (the kernel registry's)."""
    global _backend_names
    _backend_names = provider


#: modules that install the backend names and recipe types above when imported (loaded by
#: name, the first time a setting is checked against them: core never imports them)
PROVIDER_MODULES = ("fusible_ops.kernels", "fusible_ops.recipes")
_providers_loaded = [False]


def _load_providers() -> None:
    if not _providers_loaded[0]:
        import importlib

        for name in PROVIDER_MODULES:
            importlib.import_module(name)
        _providers_loaded[0] = True


def current_settings() -> Settings:
    """The settings in force on this thread.

    Returns:
        The :class:`~fusible_ops.Settings` of the innermost :func:`~fusible_ops.settings`
        block on this thread, or the defaults outside any.
    """
    return _STATE.stack[-1]


#: this thread's settings stack; ``THREAD_SETTINGS.facts_key`` stands for the settings in force
THREAD_SETTINGS = _STATE


@contextlib.contextmanager
def settings(**changes: object) -> Iterator[Settings]:
    """Override settings inside a ``with`` block (thread-local, nestable).

    Settings not named keep their current values; the previous settings come back when
    the block exits. Fusion plans are cached per settings value.

    >>> import fusible_ops as fo
    >>> with fo.settings(fusion=False, backend="auto") as active:
    ...     pass  # everything in here runs unfused

    Args:
        fusion: a bool: whether fusion rules apply at all (default True).
        backend: a str: the grouped-GEMM backend, ``"auto"`` (default) or a name that
            ``python -m fusible_ops info`` lists.
        triton_autotune: a bool: whether the Triton backend autotunes its tile
            configurations (default True); else it takes the first one.
        recipe: a ``fusible_ops.recipes`` recipe or None (default): the low-precision
            recipe (:func:`fusible_ops.quantized` sets it).
        recipe_backend: a str: how quantized GEMMs run: ``"auto"`` (default),
            ``"emulation"``, ``"scaled_mm"`` or ``"scaled_grouped_mm"``.

    Returns:
        A context manager; ``with fo.settings(...) as active`` binds ``active`` to the
        :class:`~fusible_ops.Settings` in force inside the block.

    Raises:
        TypeError: an unknown setting name, or a value of the wrong type (exactly
            ``bool`` or ``str``: ``fusion="false"``, ``fusion=0`` and ``fusion=None``
            are refused).
        ValueError: a ``backend`` or ``recipe_backend`` name that is not registered.
    """
    known = {f.name for f in dataclasses.fields(Settings)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise TypeError(f"fusible_ops.settings got unknown setting(s) {unknown}; known: {sorted(known)}")
    if "recipe" in changes or "recipe_backend" in changes or "backend" in changes:
        _load_providers()
    for name, value in changes.items():
        if name == "recipe":
            if value is not None and not isinstance(value, _recipe_types[0]):
                raise TypeError(
                    f"fusible_ops.settings: recipe must be a fusible_ops.recipes recipe or None, got {value!r}"
                )
            continue
        expected = _TYPES[name]
        if type(value) is not expected:  # bool is an int subclass, and 0/1 are not bools here
            raise TypeError(
                f"fusible_ops.settings: {name} must be a {expected.__name__}, got {value!r} "
                f"({type(value).__name__})"
            )
    if "recipe_backend" in changes:
        RECIPE_BACKENDS = _recipe_types[1]
        if changes["recipe_backend"] not in RECIPE_BACKENDS:
            raise ValueError(
                f"fusible_ops.settings: unknown recipe_backend {changes['recipe_backend']!r}; choose one of {RECIPE_BACKENDS}"
            )
    if "backend" in changes:
        names = _backend_names()
        if changes["backend"] != "auto" and changes["backend"] not in names:
            raise ValueError(
                f"fusible_ops.settings: unknown backend {changes['backend']!r}; "
                f"choose 'auto' or one of {names} (see `python -m fusible_ops info`)"
            )
    if changes.get("recipe") is not None:
        RECIPE_CONTEXT_USED[0] = True
    new = dataclasses.replace(current_settings(), **changes)
    _STATE.stack.append(new)
    _STATE.top_changed()
    try:
        yield new
    finally:
        _STATE.stack.pop()
        _STATE.top_changed()
