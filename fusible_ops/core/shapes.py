"""Row views that take no view op when the tensor already has the wanted shape.

At tiny sizes every ``reshape`` costs microseconds of dispatch even when it changes
nothing; the ops call these on every forward and backward.
"""

from __future__ import annotations

import torch


def as_rows(tensor: torch.Tensor, features: int) -> torch.Tensor:
    """``tensor`` as ``[rows, features]``: itself when it is already that, else ``reshape``."""
    if tensor.dim() == 2 and tensor.shape[1] == features:
        return tensor
    return tensor.reshape(-1, features)


def as_flat(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as 1-D: itself when it is already, else ``reshape(-1)``."""
    return tensor if tensor.dim() == 1 else tensor.reshape(-1)
