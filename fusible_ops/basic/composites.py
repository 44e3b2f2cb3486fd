"""Composite modules built from basic ops."""

from __future__ import annotations

import torch

from ..fuser.sequential import Sequential
from .linear import BasicLinear, Bias


class Linear(Sequential):
    """``y = x @ weight.T + bias``: ``torch.nn.Linear`` as ``Sequential(BasicLinear, Bias)``.

    A :class:`~fusible_ops.Sequential` of :class:`~fusible_ops.BasicLinear` (``weight``
    ``[out_features, in_features]``) and, with ``bias``, :class:`~fusible_ops.Bias`
    (``bias`` ``[out_features]``); both initialised as ``torch.nn.Linear``'s.

    Args:
        in_features: the size of each input row, a positive int.
        out_features: the size of each output row, a positive int.
        bias: add a learnable bias. Default: True.
        device: where the parameters are made. Default: torch's default device.
        dtype: the parameters' dtype. Default: torch's default dtype.

    Shape:
        input: ``[..., in_features]``, floating point, the weight's dtype (any floating
            dtype but float64 under autocast) and device.
        output: ``[..., out_features]``.
    """

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
