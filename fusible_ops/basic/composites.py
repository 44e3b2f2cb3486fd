"""Composite modules built from basic ops."""

from __future__ import annotations

import torch

from ..fuser.sequential import Sequential
from .linear import BasicLinear, Bias


class Linear(Sequential):
    """``torch.nn.Linear`` as ``Sequential(BasicLinear, Bias)``: ``weight`` ``[out, in]``, ``bias`` ``[out]``."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, *, device=None, dtype=None
    ) -> None:
        modules: list[torch.nn.Module] = [BasicLinear(in_features, out_features, device=device, dtype=dtype)]
        if bias:
            modules.append(Bias(out_features, device=device, dtype=dtype))
        super().__init__(*modules)
        if bias:
            bound = 1.0 / in_features**0.5
            with torch.no_grad():
                modules[1].bias.uniform_(-bound, bound)

    @property
    def weight(self) -> torch.nn.Parameter:
        """The weight, ``[out_features, in_features]`` (the ``BasicLinear``'s)."""
        return self[0].weight

    @property
    def bias(self) -> torch.nn.Parameter | None:
        """The bias, ``[out_features]``, or None when built with ``bias=False``."""
        return self[1].bias if len(self) > 1 else None
