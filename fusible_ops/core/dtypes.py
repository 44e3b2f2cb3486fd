"""Compute dtype under autocast: the linear ops compute in autocast's dtype when it is on.

Follows torch's autocast eligibility rule op for op: floating-point tensors other than
float64 are cast; float64 stays float64 (as ``nn.Linear`` does)."""

from __future__ import annotations

import torch


def compute_dtype(input_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """Autocast's dtype for ``device`` when autocast is enabled there and ``input_dtype`` is
    eligible (floating point, not float64), else ``input_dtype``."""
    return _autocast_dtype(input_dtype, device.type)


def compute_dtype_of(tensor: torch.Tensor) -> torch.dtype:
    """:func:`compute_dtype` of a tensor's dtype and device (without building a device object)."""
    return _autocast_dtype(tensor.dtype, "cpu" if tensor.is_cpu else tensor.device.type)


def _autocast_dtype(input_dtype: torch.dtype, device_type: str) -> torch.dtype:
    if (
        input_dtype.is_floating_point
        and input_dtype is not torch.float64
        and torch.is_autocast_enabled(device_type)
    ):
        return torch.get_autocast_dtype(device_type)
    return input_dtype


def cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``t`` in ``dtype`` (no copy when it already is)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)
