"""Test tolerances from a rounding-error model, never from what one CPU printed.

A sum of ``n`` terms in a floating dtype with unit roundoff ``u = eps / 2``, taken in ANY
order, is off by at most ``gamma_n * sum|x_i|`` with ``gamma_n = n u / (1 - n u)``
(Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 4.2).
Relative to the result that is ``gamma_n * kappa``, ``kappa = sum|x_i| / |sum x_i|`` being
the sum's condition. CPUs with AVX-512, AVX2 or no vector unit (``ATEN_CPU_CAPABILITY``),
and sharded or fused computations, differ only in the order of their sums, so a
tolerance of this form holds on all of them. A chain of layers adds its reductions'
bounds (first order), which is what ``terms`` counts when a result passes through several.

Low precision: rounding every operand to a dtype with unit roundoff ``u`` makes each
product off by ``2u``; the same ``gamma`` form applies with ``terms`` counting roundings.
"""

from __future__ import annotations

import torch


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u = eps / 2``: the largest relative error of one rounding to ``dtype``."""
    return torch.finfo(dtype).eps / 2


def rounding_rtol(dtype: torch.dtype, terms: int, condition: float = 1.0) -> float:
    """Worst-case relative error of ``terms`` accumulated roundings in ``dtype`` (any order).

    Args:
        dtype: the dtype the arithmetic runs in.
        terms: reduction length, summed over the chain of reductions the result went through.
        condition: ``sum|x_i| / |sum x_i|`` of the reductions (1 for sums of like signs;
            measured against the largest reference magnitude, a few for random data).
    """
    nu = terms * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"{terms} roundings in {dtype} leave no significant digit")
    return condition * nu / (1 - nu)


def tolerance(dtype: torch.dtype, terms: int, condition: float = 1.0) -> dict[str, float]:
    """``rtol``/``atol`` for ``torch.testing.assert_close`` of unit-scale data: the atol covers
    entries near zero, whose error is relative to the data's scale (about 1), not to themselves."""
    tol = rounding_rtol(dtype, terms, condition)
    return {"rtol": tol, "atol": tol}


class AdamDrift:
    """Per-element bound on the distance between two Adam runs whose gradients differ.

    Adam's step is ``lr * m_hat / sqrt(v_hat)``: a gradient error ``dg`` moves it by at most
    about ``2 lr dg / sqrt(v_hat)`` per element (``m_hat`` and ``sqrt(v_hat)`` both move), and
    an error in an earlier gradient stays in ``m`` for every later step. Elements with tiny
    ``v_hat`` are ill-conditioned (a step is ``lr * sign(g)``): their bound is large, as the
    true drift can be. ``update`` after each reference step with that step's gradient error
    bound; ``bound`` is then the largest admissible ``|w - w_ref|`` per element.
    """

    def __init__(self, optimizer: torch.optim.Adam) -> None:
        self.optimizer = optimizer
        self._grad_error: dict[torch.Tensor, float] = {}
        self._bound: dict[torch.Tensor, torch.Tensor] = {}

    def update(self, param: torch.Tensor, grad_error: float) -> None:
        """Call after ``optimizer.step()``; ``grad_error``: bound on this step's ``|dg|``."""
        group = next(g for g in self.optimizer.param_groups if any(p is param for p in g["params"]))
        state = self.optimizer.state[param]
        beta2 = group["betas"][1]
        v_hat = state["exp_avg_sq"] / (1 - beta2 ** float(state["step"]))
        accumulated = self._grad_error.get(param, 0.0) + grad_error
        self._grad_error[param] = accumulated
        step_bound = 2 * group["lr"] * accumulated / (v_hat.sqrt() + group["eps"])
        self._bound[param] = self._bound.get(param, 0) + step_bound

    def bound(self, param: torch.Tensor) -> torch.Tensor:
        return self._bound[param]


def expert_block_terms(hidden: int, ffn: int, rows: int) -> int:
    """Reductions a gradient of ``GroupedLinear -> GLU -> GroupedLinear`` passes through, in
    any of its outputs: fc1 (``hidden``), fc2 (``ffn``), back through fc2 (``hidden``) and fc1
    (``2 ffn``), and the weight gradients' sums over the ``rows`` of a group."""
    return hidden + ffn + hidden + 2 * ffn + rows


#: Roundings to a low-precision dtype along the expert block: fc1's, the activation's and
#: fc2's outputs forward; the output gradient, fc2's dgrad, the activation's backward,
#: fc1's dgrad backward (GEMMs accumulate in float32, so each stored result rounds once).
EXPERT_BLOCK_ROUNDINGS = 7

#: Two computations that both round, compared with each other: their bounds add.
BOTH_SIDES = 2


def dot_tolerance(dtype: torch.dtype, length: int, scale: float = 1.0) -> dict[str, float]:
    """``rtol``/``atol`` for dot products of ``length`` terms of entries of magnitude about
    ``scale`` (unit normal: 1): the atol is ``gamma_n * sum|x_i w_i|``, with ``length * scale**2``
    bounding that sum (about ``0.64 length`` for unit normals), for entries that cancel to
    near zero; the rtol covers the rest at condition 4."""
    return {
        "rtol": rounding_rtol(dtype, length, condition=4),
        "atol": rounding_rtol(dtype, length) * length * scale**2,
    }
