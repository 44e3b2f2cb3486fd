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

from .base import GroupedGemmBackend
from .grouped_checks import check_dgrad, check_fprop, check_wgrad, host_split_sizes


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

    def probe(self, device: torch.device, dtype: torch.dtype) -> str | None:
        if not dtype.is_floating_point:
            return f"{self.name}: dtype {dtype} is not a floating-point dtype"
        return None

    def fprop(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        split_sizes: list[int] | None,
        offsets: torch.Tensor,
        *,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``out[rows_g] = x[rows_g] @ weight[g].T (+ bias[g])``: ``[M, K] -> [M, N]``."""
        where = f"{self.name}.fprop"
        groups, n_out, k_in = check_fprop(where, x, weight, split_sizes, offsets, bias, out)
        sizes = self._sizes(where, split_sizes, offsets, x)
        if out is None:
            whole = self._fprop_unbuffered(x, weight, bias, sizes)
            if whole is not None:
                return whole
            out = self._alloc_rows(x.shape[0], n_out, sizes, x)
        self._fprop_groups(x, weight, bias, sizes, out)
        return out

    def dgrad(
        self,
        grad_out: torch.Tensor,
        weight: torch.Tensor,
        split_sizes: list[int] | None,
        offsets: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``out[rows_g] = grad_out[rows_g] @ weight[g]``: ``[M, N] -> [M, K]``."""
        where = f"{self.name}.dgrad"
        groups, n_out, k_in = check_dgrad(where, grad_out, weight, split_sizes, offsets, out)
        sizes = self._sizes(where, split_sizes, offsets, grad_out)
        if out is None:
            whole = self._dgrad_unbuffered(grad_out, weight, sizes)
            if whole is not None:
                return whole
            out = self._alloc_rows(grad_out.shape[0], k_in, sizes, grad_out)
        self._dgrad_groups(grad_out, weight, sizes, out)
        return out

    def wgrad(
        self,
        grad_out: torch.Tensor,
        x: torch.Tensor,
        split_sizes: list[int] | None,
        offsets: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``out[g] = grad_out[rows_g].T @ x[rows_g]``: ``[G, N, K]``, zeros for empty groups."""
        where = f"{self.name}.wgrad"
        shape = check_wgrad(where, grad_out, x, split_sizes, offsets, out)
        sizes = self._sizes(where, split_sizes, offsets, x)
        if out is None:
            whole = self._wgrad_unbuffered(grad_out, x, sizes, shape)
            if whole is not None:
                return whole
            out = self._empty(shape, x)
        self._wgrad_groups(grad_out, x, sizes, out)
        return out

    def bias_grad(
        self, grad_out: torch.Tensor, split_sizes: list[int] | None, offsets: torch.Tensor, num_groups: int
    ) -> torch.Tensor:
        """``[G, N]`` per-group column sums of ``grad_out``, accumulated in fp32 (fp64 stays fp64)."""
        where = f"{self.name}.bias_grad"
        if grad_out.dim() != 2:
            raise ValueError(f"{where}: grad_out must be 2-D, got shape {tuple(grad_out.shape)}")
        if offsets.shape[0] != num_groups:
            raise ValueError(f"{where}: offsets has {offsets.shape[0]} entries for {num_groups} groups")
        sizes = self._sizes(where, split_sizes, offsets, grad_out)
        acc_dtype = torch.float64 if grad_out.dtype == torch.float64 else torch.float32
        acc = torch.zeros(num_groups, grad_out.shape[1], dtype=acc_dtype, device=grad_out.device)
        for g, start, end in _row_ranges(sizes):
            torch.sum(grad_out[start:end], dim=0, dtype=acc_dtype, out=acc[g])
        return acc.to(grad_out.dtype)

    # ------------------------------------------------------------ GEMM bodies (after validation)
    # ``*_unbuffered``: a result computed without a preallocated ``out`` (None: not taken)
    def _fprop_unbuffered(self, x, weight, bias, sizes: list[int]) -> torch.Tensor | None:
        return None

    def _dgrad_unbuffered(self, grad_out, weight, sizes: list[int]) -> torch.Tensor | None:
        return None

    def _wgrad_unbuffered(self, grad_out, x, sizes: list[int], shape) -> torch.Tensor | None:
        return None

    def _fprop_groups(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        sizes: list[int],
        out: torch.Tensor,
    ) -> None:
        for g, start, end in _row_ranges(sizes):
            if bias is None:
                torch.mm(x[start:end], weight[g].t(), out=out[start:end])
            else:
                torch.addmm(bias[g], x[start:end], weight[g].t(), out=out[start:end])

    def _dgrad_groups(
        self, grad_out: torch.Tensor, weight: torch.Tensor, sizes: list[int], out: torch.Tensor
    ) -> None:
        for g, start, end in _row_ranges(sizes):
            torch.mm(grad_out[start:end], weight[g], out=out[start:end])

    def _wgrad_groups(
        self, grad_out: torch.Tensor, x: torch.Tensor, sizes: list[int], out: torch.Tensor
    ) -> None:
        start = 0
        for g, size in enumerate(sizes):
            if size:
                torch.mm(grad_out[start : start + size].t(), x[start : start + size], out=out[g])
            else:
                out[g].zero_()
            start += size

    # ------------------------------------------------------------ helpers
    @staticmethod
    def _sizes(
        where: str, split_sizes: list[int] | None, offsets: torch.Tensor, rows: torch.Tensor
    ) -> list[int]:
        sizes = host_split_sizes(split_sizes, offsets)
        if split_sizes is None and sum(sizes) > rows.shape[0]:
            raise ValueError(f"{where}: offsets end at {sum(sizes)} but the input has {rows.shape[0]} rows")
        return sizes

    def _empty(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """Uninitialised contiguous output of ``like``'s dtype and device (subclasses may pool)."""
        return torch.empty(shape, dtype=like.dtype, device=like.device)

    def _alloc_rows(self, rows: int, cols: int, sizes: list[int], like: torch.Tensor) -> torch.Tensor:
        """``[rows, cols]``; rows past the last group (not computed) are zeros, not garbage."""
        out = self._empty((rows, cols), like)
        covered = sum(sizes)
        if covered < rows:
            out[covered:].zero_()
        return out
