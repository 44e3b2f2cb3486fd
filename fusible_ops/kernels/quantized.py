"""Quantized GEMMs: which engine runs a recipe on a device, and the calls ops make.

Ops quantize their operands with :mod:`fusible_ops.recipes` and call :func:`fprop`,
:func:`dgrad` and :func:`wgrad` (grouped) or :func:`linear_fprop`, :func:`linear_dgrad`
and :func:`linear_wgrad` (dense) with the chosen :class:`QuantizedChoice`. Engines:

- ``emulation`` (any device): dequantize to fp32, then the fp32 grouped-GEMM backend
  (or ``torch.mm``); the exact reference semantics (:mod:`.quantized_cpu`);
- ``scaled_mm`` (CPU): ``torch._scaled_mm`` per group on the FP8 data, tensorwise and
  rowwise scales, host split sizes (:mod:`.quantized_cpu`);
- ``scaled_grouped_mm`` (CUDA, rowwise, SM90+): ``torch.nn.functional.scaled_grouped_mm``
  (:mod:`.quantized_cuda`).

Every GEMM accumulates in fp32; results are returned in the caller's dtype, written
into ``out`` when given (the same cast as without it, so bit-identical).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.splits import SplitInfo
from ..recipes.quantize import QuantizedOperand
from ..recipes.recipes import Float8Rowwise, Float8Tensorwise, Recipe
from . import BackendChoice, select_backend

Tensor = torch.Tensor


@dataclass(frozen=True)
class QuantizedChoice:
    """How one op (or fused op) runs its GEMMs under ``recipe``.

    ``engine``: the quantized-GEMM engine; ``high_precision``: the grouped backend for
    the op's unquantized work (bias gradients, a high-precision wgrad; None for dense
    ops); ``fp32``: the grouped backend the emulation's fp32 GEMMs run on; ``skipped``:
    engines preferred over ``engine`` and why they cannot run.
    """

    recipe: Recipe
    engine: str
    high_precision: BackendChoice | None
    fp32: BackendChoice | None
    skipped: tuple[tuple[str, str], ...] = ()

    @property
    def backend(self):
        """The grouped backend of the unquantized work (what ops read as ``choice.backend``)."""
        return None if self.high_precision is None else self.high_precision.backend

    @property
    def name(self) -> str:
        return f"{self.recipe.name}:{self.engine}"

    def explain(self) -> str:
        gemms = self.recipe.quantized_gemms()
        text = f"recipe {self.recipe!r}: {', '.join(gemms)} quantized"
        if "wgrad" not in gemms:
            text += ", wgrad high precision (wgrad_high_precision=True)"
        text += f"; engine {self.engine}"
        if self.engine == "scaled_grouped_mm" and "wgrad" in gemms:
            text += " (wgrad in the emulation: its groups lie along the contraction dim)"
        if self.skipped:
            text += " (not run: " + "; ".join(f"{n}: {r}" for n, r in self.skipped) + ")"
        return text


def _scaled_mm_reason(recipe: Recipe, device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cpu":
        return "torch._scaled_mm per group is the CPU engine"
    if type(recipe) not in (Float8Tensorwise, Float8Rowwise):
        return f"torch 2.13's CPU scaled_mm takes tensorwise and rowwise scales, not {recipe.name}"
    if torch.compiler.is_compiling():
        return "the per-group scaled_mm loop needs host split sizes (eager only)"
    return None


def _scaled_grouped_mm_reason(recipe: Recipe, device: torch.device, dtype: torch.dtype) -> str | None:
    from .quantized_cuda import scaled_grouped_mm_reason

    return scaled_grouped_mm_reason(recipe, device, dtype)


_ENGINE_REASONS = {
    "emulation": lambda recipe, device, dtype: None,
    "scaled_mm": _scaled_mm_reason,
    "scaled_grouped_mm": _scaled_grouped_mm_reason,
}

#: automatic choice per device type, best first
_ENGINE_PREFERENCE = {"cuda": ("scaled_grouped_mm", "emulation"), "cpu": ("emulation",)}


class QuantizedBackendError(RuntimeError):
    """A forced quantized-GEMM engine cannot run the recipe here."""


def select_quantized(
    recipe: Recipe,
    device: torch.device,
    dtype: torch.dtype,
    *,
    grouped: bool,
    forced_backend: str = "auto",
    engine: str = "auto",
    features: tuple[tuple[int, int], ...] = (),
) -> QuantizedChoice:
    """The engine for ``recipe`` on ``device`` (``engine`` forced or ``"auto"``), with the
    grouped backends its unquantized and emulated parts use (``grouped``: a grouped op)."""
    skipped: list[tuple[str, str]] = []
    if engine != "auto":
        reason = _ENGINE_REASONS[engine](recipe, device, dtype)
        if reason is not None:
            raise QuantizedBackendError(
                f"recipe backend {engine!r} was forced with fusible_ops.quantized(..., backend=...) but cannot "
                f"run {recipe!r} on {device.type}: {reason}"
            )
        chosen = engine
    else:
        chosen = "emulation"
        for name in _ENGINE_PREFERENCE.get(device.type, ("emulation",)):
            reason = _ENGINE_REASONS[name](recipe, device, dtype)
            if reason is None:
                chosen = name
                break
            skipped.append((name, reason))
    # every other engine, and why it did not run (the plan is never silent about it)
    for name, why in _ENGINE_REASONS.items():
        if name != chosen and name not in dict(skipped):
            reason = why(recipe, device, dtype)
            skipped.append(
                (
                    name,
                    reason
                    or f"not automatic here; opt in with fusible_ops.quantized(recipe, backend={name!r})",
                )
            )
    high = fp32 = None
    if grouped:
        high = select_backend(device, dtype, purpose="gemm", forced=forced_backend, features=features)
        fp32 = select_backend(device, torch.float32, purpose="gemm", forced=forced_backend, features=features)
    return QuantizedChoice(recipe, chosen, high, fp32, tuple(skipped))


# ---------------------------------------------------------------- grouped GEMMs


def _engine(choice: QuantizedChoice):
    if choice.engine == "scaled_grouped_mm":
        from . import quantized_cuda

        return quantized_cuda
    from . import quantized_cpu

    return quantized_cpu


def _deliver(result: Tensor, out: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``result`` in ``dtype``, in ``out`` when given (the same cast either way)."""
    if out is None:
        return result if result.dtype == dtype else result.to(dtype)
    return out.copy_(result)


def fprop(
    choice: QuantizedChoice,
    x: QuantizedOperand,
    weight: QuantizedOperand,
    splits: SplitInfo,
    bias: Tensor | None,
    out: Tensor | None,
    dtype: torch.dtype,
) -> Tensor:
    """``[M, K] x [G, N, K] -> [M, N]`` in ``dtype``: ``x`` and ``weight`` quantized along K."""
    return _deliver(_engine(choice).grouped_fprop(choice, x, weight, splits, bias), out, dtype)


def dgrad(
    choice: QuantizedChoice,
    grad_out: QuantizedOperand,
    weight: QuantizedOperand,
    splits: SplitInfo,
    out: Tensor | None,
    dtype: torch.dtype,
) -> Tensor:
    """``[M, N] x [G, N, K] -> [M, K]`` in ``dtype``: both quantized along N."""
    return _deliver(_engine(choice).grouped_dgrad(choice, grad_out, weight, splits), out, dtype)


def wgrad(
    choice: QuantizedChoice, grad_out: QuantizedOperand, x: QuantizedOperand, splits: SplitInfo
) -> Tensor:
    """fp32 ``[G, N, K]``: ``grad_out[rows_g]^T @ x[rows_g]``, both quantized along the rows
    of each group; zeros for empty groups."""
    return _engine(choice).grouped_wgrad(choice, grad_out, x, splits)


# ---------------------------------------------------------------- dense GEMMs (one group)


def linear_fprop(
    choice: QuantizedChoice, x: QuantizedOperand, weight: QuantizedOperand, bias, dtype
) -> Tensor:
    """``[M, K] x [N, K] -> [M, N]`` in ``dtype``."""
    return _deliver(_engine(choice).dense_fprop(choice, x, weight, bias), None, dtype)


def linear_dgrad(
    choice: QuantizedChoice, grad_out: QuantizedOperand, weight: QuantizedOperand, dtype
) -> Tensor:
    """``[M, N] x [N, K] -> [M, K]`` in ``dtype``."""
    return _deliver(_engine(choice).dense_dgrad(choice, grad_out, weight), None, dtype)


def linear_wgrad(choice: QuantizedChoice, grad_out: QuantizedOperand, x: QuantizedOperand) -> Tensor:
    """fp32 ``[N, K]``: ``grad_out^T @ x`` over every row."""
    return _engine(choice).dense_wgrad(choice, grad_out, x)
