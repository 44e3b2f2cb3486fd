"""The safe fallback backend: a per-group loop of ``torch.mm`` / ``torch.addmm``.

Works for every floating dtype (float64 included), every device and any strides, because
each group is one ordinary ``torch.mm`` call writing into a row slice of ``out``.
It needs the split sizes on the host: when given ``split_sizes=None`` it reads
``offsets.tolist()``, which **synchronises with the device** on CUDA. Use it where
``torch._grouped_mm`` refuses the dtype or layout, and as the reference the other
backends are tested against.
"""

from __future__ import annotations

import torch

from ..base import GroupedGemmBackend


def _row_ranges(split_sizes: list[int]) -> list[tuple[int, int, int]]:
    """``(group, start, end)`` for every group that owns at least one row."""
    ranges = []
    start = 0
    for group, size in enumerate(split_sizes):
        if size:
            ranges.append((group, start, start + size))
        start += size
    return ranges


class TorchLoopBackend(GroupedGemmBackend):
    """One ``torch.mm`` per non-empty group, written into ``out`` slices (no copy)."""

    name = "torch_loop"
    description = (
        "per-group torch.mm loop; any float dtype, device and strides; host sync when splits unknown"
    )
    fused_activation = False
    writes_in_place = True
    needs_host_splits = True

    def probe(self, device: torch.device, dtype: torch.dtype) -> str | None:
        if not dtype.is_floating_point:
            return f"{self.name}: dtype {dtype} is not a floating-point dtype"
        return None

    # ------------------------------------------------------------ hooks (arguments checked, host sizes)
    def _fprop(self, x, weight, split_sizes, offsets, bias, out) -> torch.Tensor:
        if out is None:
            out = self._rows_out(x.shape[0], weight.shape[1], split_sizes, x)
        self._fprop_groups(x, weight, bias, split_sizes, out)
        return out

    def _dgrad(self, grad_out, weight, split_sizes, offsets, out) -> torch.Tensor:
        if out is None:
            out = self._rows_out(grad_out.shape[0], weight.shape[2], split_sizes, grad_out)
        self._dgrad_groups(grad_out, weight, split_sizes, out)
        return out

    def _wgrad(self, grad_out, x, split_sizes, offsets, out) -> torch.Tensor:
        if out is None:
            out = self._empty((len(split_sizes), grad_out.shape[1], x.shape[1]), x)
        self._wgrad_groups(grad_out, x, split_sizes, out)
        return out

    def _bias_grad(self, grad_out, split_sizes, offsets, num_groups) -> torch.Tensor:
        """Per-group ``torch.sum`` into an fp32 (fp64 for fp64) accumulator."""
        acc_dtype = torch.float64 if grad_out.dtype == torch.float64 else torch.float32
        acc = torch.zeros(num_groups, grad_out.shape[1], dtype=acc_dtype, device=grad_out.device)
        for g, start, end in _row_ranges(split_sizes):
            torch.sum(grad_out[start:end], dim=0, dtype=acc_dtype, out=acc[g])
        return acc.to(grad_out.dtype)

    # ------------------------------------------------------------ GEMM bodies (into ``out``)
    def _fprop_groups(self, x, weight, bias, sizes: list[int], out) -> None:
        for g, start, end in _row_ranges(sizes):
            if bias is None:
                torch.mm(x[start:end], weight[g].t(), out=out[start:end])
            else:
                torch.addmm(bias[g], x[start:end], weight[g].t(), out=out[start:end])

    def _dgrad_groups(self, grad_out, weight, sizes: list[int], out) -> None:
        for g, start, end in _row_ranges(sizes):
            torch.mm(grad_out[start:end], weight[g], out=out[start:end])

    def _wgrad_groups(self, grad_out, x, sizes: list[int], out) -> None:
        start = 0
        for g, size in enumerate(sizes):
            if size:
                torch.mm(grad_out[start : start + size].t(), x[start : start + size], out=out[g])
            else:
                out[g].zero_()
            start += size

    # ------------------------------------------------------------ helpers
    def _empty(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """Uninitialised contiguous output of ``like``'s dtype and device (subclasses may pool)."""
        return torch.empty(shape, dtype=like.dtype, device=like.device)

    def _rows_out(self, rows: int, cols: int, sizes: list[int], like: torch.Tensor) -> torch.Tensor:
        """``[rows, cols]``; rows past the last group (not computed) are zeros, not garbage."""
        out = self._empty((rows, cols), like)
        covered = sum(sizes)
        if covered < rows:
            out[covered:].zero_()
        return out
