"""Per-tile scales from per-tile amax values (fp32), for the two scale families.

Both return ``(multiplier, scale_inv)``: quantized data is ``RNE(x * multiplier)``
(saturated) and dequantized values are ``data * scale_inv``. A tile whose amax is not
finite (it holds a NaN or an Inf) gets NaN for both, so every value of that tile
dequantizes to NaN: non-finite values propagate and are never clamped to finite ones.
"""

from __future__ import annotations

import torch

from .formats import Fp8Format

_FLOAT32_MAX = torch.finfo(torch.float32).max
E8M0_MIN_EXPONENT = -127
E8M0_MAX_EXPONENT = 127


def mx_exponents(amax: torch.Tensor, fmt: Fp8Format, rounding: str) -> torch.Tensor:
    """int32 E8M0 exponents per tile: ``"rceil"``: the smallest ``e`` with
    ``amax <= fmax * 2**e``; ``"floor"``: ``floor(log2(amax)) - emax`` (emax 8 for E4M3).

    Exact for every fp32 amax (subnormals included): ``amax = m * 2**p`` with
    ``m`` in ``[0.5, 1)``, and ``fmax = 0.875 * 2**9`` for E4M3.
    """
    mantissa, exponent = torch.frexp(amax)
    fmax_mantissa, fmax_exponent = torch.frexp(torch.tensor(fmt.fmax, dtype=torch.float32))
    emax = int(fmax_exponent) - 1  # floor(log2(fmax))
    e = exponent - 1 - emax  # floor(log2(amax)) - emax
    if rounding == "rceil":
        e = e + (mantissa > float(fmax_mantissa)).to(e.dtype)
    e = torch.where(amax == 0, torch.full_like(e, E8M0_MIN_EXPONENT), e)
    return e.clamp(E8M0_MIN_EXPONENT, E8M0_MAX_EXPONENT)


def mx_scales(amax: torch.Tensor, fmt: Fp8Format, rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(2**-e, 2**e)`` per tile in fp32 (NaN for a non-finite amax)."""
    e = mx_exponents(amax, fmt, rounding)
    one = torch.ones_like(amax)
    finite = torch.isfinite(amax)
    nan = torch.full_like(amax, float("nan"))
    multiplier = torch.where(finite, torch.ldexp(one, -e), nan)
    scale_inv = torch.where(finite, torch.ldexp(one, e), nan)
    return multiplier, scale_inv


def float_scales(amax: torch.Tensor, fmt: Fp8Format, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, 1 / scale)`` per tile in fp32 with ``scale = fmax / amax``.

    ``amax == 0`` gives scale 1; a tiny amax whose scale overflows gives the largest
    fp32; ``pow2`` rounds the scale down to a power of two (``2**floor(log2(scale))``).
    """
    scale = torch.full_like(amax, fmt.fmax) / amax
    scale = torch.where(amax == 0, torch.ones_like(amax), scale)
    scale = torch.where(torch.isinf(scale) & (amax > 0), torch.full_like(amax, _FLOAT32_MAX), scale)
    if pow2:
        _, exponent = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), exponent - 1)
    scale = torch.where(torch.isfinite(amax), scale, torch.full_like(amax, float("nan")))
    return scale, torch.reciprocal(scale)


def e8m0_bytes(scale_inv: torch.Tensor) -> torch.Tensor:
    """MX scales ``2**e`` (fp32) as E8M0 codes ``e + 127`` (uint8; NaN is 0xFF)."""
    _, exponent = torch.frexp(scale_inv)
    codes = (exponent - 1 - E8M0_MIN_EXPONENT).clamp(0, 254)
    codes = torch.where(torch.isnan(scale_inv), torch.full_like(codes, 255), codes)
    return codes.to(torch.uint8)
