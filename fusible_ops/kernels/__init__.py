"""Kernel backends: how grouped GEMMs and activations are computed on a device.

Each backend lives in its own file and is imported only when first asked for, so
optional packages (triton, cudnn frontend) are never imported with the package.
Selection is automatic per device and dtype, or forced with
``fusible_ops.settings(backend=NAME)``.

Owns the backend registry and selection, the backend base class, the shared activation
math and call checks (this package's own modules), the ``fusible_ops::`` custom-op library
with its Inductor lowering, and one subpackage per backend family: ``cpu``, ``pytorch``
(``torch._grouped_mm`` and a per-group loop), ``triton``, ``cudnn``. Kernels decide *how*
the math runs; they import only ``core`` (and ``recipes``), never the ops or the fuser.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

import torch

from ..core.registry_versions import registries_changed
from ..core.settings import set_backend_names_provider
from .base import GroupedGemmBackend
from .conformance import BackendConformanceError as BackendConformanceError
from .conformance import run_conformance_probe

# name -> (module, class) imported on first use, or the class itself; the order within a
# device's preference list is separate
_BACKENDS: dict[str, tuple[str, str] | type[GroupedGemmBackend]] = {
    "cpu": ("fusible_ops.kernels.cpu.backend", "TorchCpuBackend"),
    "grouped_mm": ("fusible_ops.kernels.pytorch.grouped_mm", "TorchGroupedMMBackend"),
    "triton": ("fusible_ops.kernels.triton.backend", "TritonBackend"),
    "cudnn": ("fusible_ops.kernels.cudnn.backend", "CudnnFrontendBackend"),
    "torch_loop": ("fusible_ops.kernels.pytorch.loop", "TorchLoopBackend"),
}

# automatic choice, best first; "mlp" is the fused grouped MLP, "gemm" a lone GroupedLinear
_PREFERENCE: dict[tuple[str, str], tuple[str, ...]] = {
    ("cpu", "mlp"): ("cpu", "torch_loop"),
    ("cpu", "gemm"): ("cpu", "torch_loop"),
    ("cuda", "mlp"): ("cudnn", "triton", "grouped_mm", "torch_loop"),
    ("cuda", "gemm"): ("grouped_mm", "triton", "torch_loop"),
}
_DEFAULT_PREFERENCE = ("torch_loop",)

_instances: dict[str, GroupedGemmBackend] = {}
#: the library's own backends, by (module, class): trusted, not probed
_LIBRARY_ENTRIES = frozenset(entry for entry in _BACKENDS.values() if isinstance(entry, tuple))
#: names registered by module path whose conformance probe runs when first imported
_probe_pending: set[str] = set()


def _is_library_entry(entry: tuple[str, str] | type) -> bool:
    if isinstance(entry, tuple):
        return entry in _LIBRARY_ENTRIES
    return (entry.__module__, entry.__qualname__) in _LIBRARY_ENTRIES


def _backend_class(name: str, entry: tuple[str, str] | type) -> type[GroupedGemmBackend]:
    """The class of a registry entry (imported when given by path), checked."""
    cls = getattr(importlib.import_module(entry[0]), entry[1]) if isinstance(entry, tuple) else entry
    if not (isinstance(cls, type) and issubclass(cls, GroupedGemmBackend)):
        raise TypeError(
            f"backend {name!r}: {cls!r} is not a GroupedGemmBackend subclass (see fusible_ops.kernels.base)"
        )
    return cls


def _new_instance(name: str, entry: tuple[str, str] | type) -> GroupedGemmBackend:
    backend = _backend_class(name, entry)()
    if type(backend).name == GroupedGemmBackend.name:
        backend.name = name  # messages and plans name it as registered
    return backend


def backend_names() -> list[str]:
    """Every registered backend name (available here or not)."""
    return list(_BACKENDS)


set_backend_names_provider(backend_names)  # fusible_ops.settings(backend=...) checks against these


def register_backend(
    name: str,
    backend: type[GroupedGemmBackend] | str,
    class_name: str | None = None,
    *,
    prefer_on: tuple[str, ...] = (),
    probe: bool = True,
) -> None:
    """Register a backend: its class, or a module path and class name imported on first use.

    ``register_backend("mine", MyBackend)`` or ``register_backend("mine", "pkg.mine", "MyBackend")``;
    ``prefer_on`` device types (``"cpu"``, ``"cuda"``) try it first in automatic selection.
    A registered name replaces the entry it had.

    A class is run through the conformance probe (``fusible_ops.kernels.conformance``) before it is
    registered: it is refused with ``BackendConformanceError`` (a ``ValueError``)
    naming the method and what was wrong. A backend given by module path is probed when
    first imported, and raises that error then. ``probe=False`` skips the probe; its
    correctness is then the caller's to test. Either way, every call of a user's backend
    checks the structure of each hook's result (shape, dtype, ``out`` returned).
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_backend: name must be a non-empty str, got {name!r}")
    where = f"register_backend({name!r})"
    if isinstance(backend, str):
        if class_name is None:
            raise TypeError(f"register_backend({name!r}, {backend!r}): a module path needs a class name")
        entry: tuple[str, str] | type = (backend, class_name)
    elif isinstance(backend, type) and issubclass(backend, GroupedGemmBackend):
        entry = backend
    else:
        raise TypeError(
            f"{where}: backend must be a GroupedGemmBackend subclass or a module path, got {backend!r}"
        )
    if isinstance(prefer_on, str) or not all(isinstance(device_type, str) for device_type in prefer_on):
        raise TypeError(
            f"{where}: prefer_on must be a tuple of device types (e.g. ('cuda',)), got {prefer_on!r}"
        )
    probed = None
    if probe and not isinstance(entry, tuple) and not _is_library_entry(entry):
        probed = _new_instance(name, entry)
        run_conformance_probe(name, probed)  # raises before anything is registered
    _BACKENDS[name] = entry
    if probe and isinstance(entry, tuple) and not _is_library_entry(entry):
        _probe_pending.add(name)
    else:
        _probe_pending.discard(name)
    clear_backend_cache()
    if probed is not None:
        _instances[name] = probed
    for device_type in prefer_on:
        for purpose in ("mlp", "gemm"):
            current = _PREFERENCE.get((device_type, purpose), _DEFAULT_PREFERENCE)
            _PREFERENCE[(device_type, purpose)] = (name, *[n for n in current if n != name])


def unregister_backend(name: str) -> None:
    """Remove ``name`` from the registry and from every automatic preference list."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: {backend_names()}")
    del _BACKENDS[name]
    _probe_pending.discard(name)
    for key, names in list(_PREFERENCE.items()):
        _PREFERENCE[key] = tuple(n for n in names if n != name)
    clear_backend_cache()


def get_backend(name: str) -> GroupedGemmBackend:
    """The backend instance called ``name`` (its module is imported on first use)."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown backend {name!r}; known: {backend_names()}")
    backend = _instances.get(name)
    if backend is None:
        backend = _new_instance(name, _BACKENDS[name])
        if name in _probe_pending:
            run_conformance_probe(name, backend)  # raises on every use until re-registered
            _probe_pending.discard(name)
        _instances[name] = backend
    return backend


def probe_backend(
    name: str, device: torch.device, dtype: torch.dtype, *, automatic: bool = False
) -> str | None:
    """``None`` when ``name`` can run on ``device``/``dtype``, else the reason.

    ``automatic=True`` asks whether automatic selection may pick it (some backends
    are opt-in only).
    """
    try:
        backend = get_backend(name)
    except ImportError as error:  # a backend module whose own imports failed
        return f"cannot import backend module: {error}"
    device = torch.device(device)
    return backend.auto_probe(device, dtype) if automatic else backend.probe(device, dtype)


@dataclass(frozen=True)
class BackendChoice:
    """The selected backend and why the ones preferred over it were skipped."""

    backend: GroupedGemmBackend
    skipped: tuple[tuple[str, str], ...]

    @property
    def name(self) -> str:
        """The selected backend's registered name."""
        return self.backend.name

    def explain(self) -> str:
        """One line for the plan: the backend, and why each preferred one was skipped."""
        if not self.skipped:
            return f"backend {self.name}"
        skipped = "; ".join(f"{name}: {reason}" for name, reason in self.skipped)
        return f"backend {self.name} (skipped {skipped})"


class BackendUnavailableError(RuntimeError):
    """A forced backend cannot run for these tensors."""


_choices: dict[tuple, BackendChoice] = {}


def clear_backend_cache() -> None:
    """Forget cached probe results (e.g. after installing a package in-process)."""
    _choices.clear()
    _instances.clear()
    registries_changed()  # what compiled calls guard on


def select_backend(
    device: torch.device,
    dtype: torch.dtype,
    *,
    purpose: str = "gemm",
    forced: str = "auto",
    features: tuple[tuple[int, int], ...] = (),
) -> BackendChoice:
    """Choose the backend for ``device``/``dtype``; ``forced`` names one or is "auto".

    ``features`` lists the ``(in_features, out_features)`` of every GEMM the caller will
    run; backends with size rules (``shape_problem``) are skipped when they cannot take
    them. Results are cached per arguments; a forced backend that cannot run raises
    :class:`BackendUnavailableError` with the reason.
    """
    if torch.compiler.is_compiling():
        name, skipped = _selected_names(device, dtype, purpose, forced, features)
        return BackendChoice(get_backend(name), skipped)
    return _select_cached(device, dtype, purpose, forced, features)


def _constant_result(fn):
    """``torch.compiler.assume_constant_result``, without importing ``torch._dynamo`` (about
    2 s) with the package: until something else has imported it, the function gets the
    mark that decorator sets (torch 2.13), which dynamo reads when it traces a call."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    fn._dynamo_marked_constant = True
    return fn


# Selection imports backend modules and may run a trial kernel (the probes): under
# torch.compile it runs eagerly at trace time and its result is a constant of the graph.
@_constant_result
def _selected_names(
    device: torch.device, dtype: torch.dtype, purpose: str, forced: str, features: tuple
) -> tuple[str, tuple[tuple[str, str], ...]]:
    choice = _select_cached(device, dtype, purpose, forced, features)
    return choice.name, choice.skipped


def _select_cached(
    device: torch.device, dtype: torch.dtype, purpose: str, forced: str, features: tuple
) -> BackendChoice:
    key = (device, dtype, purpose, forced, features)
    choice = _choices.get(key)
    if choice is None:
        choice = _select_uncached(torch.device(device), dtype, purpose, forced, features)
        _choices[key] = choice
    return choice


def _shape_reason(name: str, dtype: torch.dtype, features: tuple[tuple[int, int], ...]) -> str | None:
    backend = get_backend(name)
    for in_features, out_features in features:
        reason = backend.shape_problem(in_features, out_features, dtype)
        if reason is not None:
            return reason
    return None


def _select_uncached(
    device: torch.device, dtype: torch.dtype, purpose: str, forced: str, features: tuple[tuple[int, int], ...]
) -> BackendChoice:
    if forced != "auto":
        reason = probe_backend(forced, device, dtype) or _shape_reason(forced, dtype, features)
        if reason is not None:
            raise BackendUnavailableError(
                f"backend {forced!r} was forced with fusible_ops.settings(backend=...) but cannot run "
                f"on {device.type} {dtype}: {reason}"
            )
        return BackendChoice(get_backend(forced), ())
    skipped = []
    for name in _PREFERENCE.get((device.type, purpose), _DEFAULT_PREFERENCE):
        reason = probe_backend(name, device, dtype, automatic=True) or _shape_reason(name, dtype, features)
        if reason is None:
            return BackendChoice(get_backend(name), tuple(skipped))
        skipped.append((name, reason))
    raise BackendUnavailableError(
        f"no grouped-GEMM backend can run on {device.type} {dtype}: "
        + "; ".join(f"{n}: {r}" for n, r in skipped)
    )


def backend_report(device: torch.device | str, dtype: torch.dtype) -> list[tuple[str, str | None]]:
    """``[(name, reason or None)]`` for every backend, for ``info``."""
    return [(name, probe_backend(name, torch.device(device), dtype)) for name in _BACKENDS]


__all__ = [
    "BackendChoice",
    "BackendUnavailableError",
    "GroupedGemmBackend",
    "backend_names",
    "backend_report",
    "clear_backend_cache",
    "get_backend",
    "probe_backend",
    "register_backend",
    "select_backend",
    "unregister_backend",
]
