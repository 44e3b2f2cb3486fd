"""The contract every grouped-GEMM backend implements.

Shapes (``G`` groups, ``M`` token rows, ``K`` in features, ``N`` out features):

- ``x``: ``[M, K]``, rows sorted by group; group ``g`` owns rows
  ``offsets[g-1]:offsets[g]`` (``offsets[-1]`` is implicitly 0).
- ``weight``: ``[G, N, K]`` (the ``[experts, out, in]`` checkpoint layout).
- ``split_sizes``: the row counts as a host ``list[int]``, or ``None`` when only the
  device-resident ``offsets`` (int32 ``[G]`` inclusive cumulative sum) are known and
  reading them would force a host sync (CUDA backends must work from ``offsets``).

Every method writes into ``out`` when it is given (a contiguous tensor of exactly the
result shape, possibly a view of a caller's buffer) and returns it; otherwise it
allocates. Rows of ``out`` beyond ``offsets[-1]`` are never written.
"""

from __future__ import annotations

import torch

from .activation import (
    ActivationSpec,
    activation_backward,
    activation_forward,
    row_dot,
    scaled_activation_forward,
)


class GroupedGemmBackend:
    """Base class: a named way to run the three grouped GEMMs on some devices.

    Subclasses implement :meth:`probe` and the three GEMMs; the fused
    activation entry points have composed defaults that a backend may override with
    a real fused kernel (``fused_activation = True``).
    """

    name: str = "base"
    description: str = ""
    #: whether fc1_fprop_act / fc2_dgrad_act run as one fused kernel
    fused_activation: bool = False
    #: whether the backend writes into a caller's ``out`` without an extra copy
    writes_in_place: bool = True

    # ------------------------------------------------------------ availability
    def probe(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """``None`` when usable for tensors on ``device`` of ``dtype``, else the reason."""
        raise NotImplementedError

    def auto_probe(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Like :meth:`probe`, for automatic selection (a backend may be opt-in only)."""
        return self.probe(device, dtype)

    def package_status(self) -> str | None:
        """``None`` when the backend's software is present, else why not (for ``info``)."""
        return None

    # ------------------------------------------------------------ grouped GEMMs
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
        """``out[rows_g] = x[rows_g] @ weight[g].T (+ bias[g])``; ``[M, N]``."""
        raise NotImplementedError

    def dgrad(
        self,
        grad_out: torch.Tensor,
        weight: torch.Tensor,
        split_sizes: list[int] | None,
        offsets: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``out[rows_g] = grad_out[rows_g] @ weight[g]``; ``[M, K]``."""
        raise NotImplementedError

    def wgrad(
        self,
        grad_out: torch.Tensor,
        x: torch.Tensor,
        split_sizes: list[int] | None,
        offsets: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``out[g] = grad_out[rows_g].T @ x[rows_g]``; ``[G, N, K]``, zeros for empty groups."""
        raise NotImplementedError

    def bias_grad(
        self, grad_out: torch.Tensor, split_sizes: list[int] | None, offsets: torch.Tensor, num_groups: int
    ) -> torch.Tensor:
        """``[G, N]`` per-group column sums of ``grad_out`` (fp32 accumulation)."""
        # rows past offsets[-1] get group id G: they land in an extra bin that is dropped
        group_ids = group_ids_from_offsets(offsets, grad_out.shape[0])
        acc_dtype = torch.promote_types(grad_out.dtype, torch.float32)
        acc = torch.zeros(num_groups + 1, grad_out.shape[-1], dtype=acc_dtype, device=grad_out.device)
        acc.index_add_(0, group_ids, grad_out.to(acc_dtype))
        return acc[:num_groups].to(grad_out.dtype)

    # ------------------------------------------------------------ fused entry points
    def fc1_fprop_act(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        split_sizes: list[int] | None,
        offsets: torch.Tensor,
        activation: ActivationSpec,
        scales: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FC1 then ``act(pre) * scales``: returns ``(pre, act_scaled)``.

        ``scales`` None means unscaled. ``pre`` is kept by the caller for backward.
        """
        pre = self.fprop(x, weight, split_sizes, offsets, bias=bias)
        if scales is None:
            return pre, activation_forward(activation, pre)
        return pre, scaled_activation_forward(activation, pre, scales)

    def fc2_dgrad_act(
        self,
        grad_y: torch.Tensor,
        weight: torch.Tensor,
        pre: torch.Tensor,
        split_sizes: list[int] | None,
        offsets: torch.Tensor,
        activation: ActivationSpec,
        scales: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """FC2 dgrad fused with the activation backward.

        Returns ``(grad_pre, grad_scales, act_scaled)`` where ``act_scaled`` is the
        recomputed FC2 input (needed for FC2's weight gradient).
        """
        grad_act = self.dgrad(grad_y, weight, split_sizes, offsets)
        act = activation_forward(activation, pre)  # recomputed once, used three times
        if scales is None:
            return activation_backward(activation, pre, grad_act), None, act
        row_scales = scales.to(act.dtype).unsqueeze(-1)
        grad_scales = row_dot(act, grad_act, scales.dtype)
        grad_pre = activation_backward(activation, pre, grad_act * row_scales)
        return grad_pre, grad_scales, act.mul_(row_scales)


def group_ids_from_offsets(offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Group index of every row, ``[num_rows]`` int64, computed on device (no sync)."""
    rows = torch.arange(num_rows, device=offsets.device, dtype=offsets.dtype)
    return torch.searchsorted(offsets, rows, right=True).long()
