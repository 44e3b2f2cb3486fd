"""FP8 element formats: the two OCP 8-bit float formats and a saturating cast to them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Fp8Format:
    """An FP8 element format.

    ``fmax``: the largest finite magnitude; ``mantissa_bits`` / ``min_exponent``: for
    rounding (the smallest normal is ``2**min_exponent``, subnormals below it).
    """

    name: str
    dtype: torch.dtype
    fmax: float
    mantissa_bits: int
    min_exponent: int

    def __repr__(self) -> str:
        return self.name.upper()


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, 3, -6)
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0, 2, -14)


def cast_saturated(values: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """Round-to-nearest-even to ``fmt``, finite values beyond ``fmax`` saturated to ``±fmax``.

    ``values``: fp32, any shape. NaN stays NaN (the clamp propagates it).
    """
    return values.clamp(-fmt.fmax, fmt.fmax).to(fmt.dtype)
