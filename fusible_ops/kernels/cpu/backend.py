"""CPU backend tuned for bf16/fp32 on oneDNN / MKL (``torch.mm``), activation fused by row blocks.

Measured on the development machine (``docs/benchmarks-cpu-kernels.md``,
``benchmarks/cpu_gemm_candidates.py``):

- per-group ``torch.mm(..., out=slice)`` runs within a few percent of one dense
  ``torch.mm`` of the same total size and writes caller buffers with no copy;
  ``torch._grouped_mm``, pre-transposed weights and contiguous ``grad_out.T`` for the
  wgrads were no faster, so the GEMMs are those of :class:`TorchLoopBackend`, except
  that a bias is added after ``torch.mm`` (faster than ``torch.addmm`` here);
- the activation passes are processed in blocks of about ``block_bytes`` of ``pre``,
  so each block and its temporaries stay in cache. FC2's dgrad writes ``grad_act``
  into the memory of the recomputed activation, which each block then overwrites,
  so no ``[M, F]`` temporary exists. SwiGLU (gate-first halves) has a hand-written
  pass; every other activation runs the reference math of :mod:`.activation` per block;
- large outputs reuse storages the caller has dropped (:class:`CpuBufferPool`), which
  avoids page-faulting tens of MB per step.

Kernels run with autograd disabled (inside the fuser's ``autograd.Function``).
"""

from __future__ import annotations

import math

import torch

from ...core.splits import host_offsets
from ..activation import ActivationSpec, activation_backward, activation_forward
from ..pytorch.loop import TorchLoopBackend, _row_ranges
from .buffer_pool import CpuBufferPool

#: activation kinds (rows of ``activation.ACTIVATIONS``) with a hand-fused pass below;
#: the others run the reference math of :mod:`.activation` per row block
HAND_FUSED_KINDS = ("swiglu",)

_GROUPED_MM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_HAS_GROUPED_MM = hasattr(torch, "_grouped_mm")

#: ``(dtype, strides, n_out, k_in) -> bool`` answers of ``TorchCpuBackend._grouped_mm_takes``
_GROUPED_MM_TAKES: dict[tuple, bool] = {}


def _grouped_mm_takes(dtype: torch.dtype, strides: tuple[int, ...], n_out: int, k_in: int) -> bool:
    if not _HAS_GROUPED_MM or dtype not in _GROUPED_MM_DTYPES or len(strides) != 2:
        return False
    size = dtype.itemsize
    elems = 16 // size
    row_stride, column_stride = strides
    return n_out % elems == 0 and k_in % elems == 0 and column_stride == 1 and (row_stride * size) % 16 == 0


#: weights up to this many elements are re-laid out for a small reduced-precision dgrad
_DGRAD_RELAYOUT_NUMEL = 1 << 20


def _dgrad_operand(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[G, N, K]`` as dgrad's right operand, column-major when that is faster.

    oneDNN's bf16/fp16 GEMM with a row-major ``[N, K]`` right operand is about 3.5x slower
    at small shapes than with a column-major one (measured: 4 groups, 64 rows, 128 -> 64,
    bf16: 358 vs 104 us; fp32 is not affected), so a small weight is copied once per call.
    """
    return _column_major(weight) if _relayout_for_dgrad(weight) else weight


def _relayout_for_dgrad(weight: torch.Tensor) -> bool:
    """Whether :func:`_dgrad_operand` copies ``weight`` (metadata only)."""
    return weight.dtype in (torch.bfloat16, torch.float16) and weight.numel() <= _DGRAD_RELAYOUT_NUMEL


def _column_major(weight: torch.Tensor) -> torch.Tensor:
    return weight.transpose(-2, -1).contiguous().transpose(-2, -1)


def _all_finite(t: torch.Tensor) -> bool:
    """Whether the masked one-GEMM result can be kept.

    That form multiplies other groups' values by 0, so an inf or NaN anywhere turns into
    NaN in every group; a non-finite result is therefore recomputed group by group
    (exact, and NaN/inf stay where they belong). A finite sum proves every element
    finite; an overflowing sum of finite values only costs the recomputation.
    """
    return math.isfinite(float(t.sum()))


# An empty group's block of a ``torch._grouped_mm`` weight gradient (``[N, M] x [M, K]``
# with the rows split) comes out as zeros on the CPU: ATen's CPU kernel runs ``mm_out``
# per group, and a product over an empty inner dimension is written as zeros. torch's
# own backward of ``_grouped_mm`` relies on the same; the conformance suite checks it
# (every backend, an empty middle group, NaN-filled buffers).


def _blocks(start: int, end: int, block: int):
    for s in range(start, end, block):
        yield s, min(s + block, end)


def _swiglu(pre: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * linear`` of gate-first halves, as a fresh tensor."""
    gate, linear = pre.chunk(2, dim=-1)  # one op for both halves
    return torch.nn.functional.silu(gate).mul_(linear)


def _forward_block(
    spec: ActivationSpec, fast: bool, pre: torch.Tensor, scales: torch.Tensor | None, out: torch.Tensor
) -> None:
    """``out = act(pre) (* scales)`` for one row block (``fast``: SwiGLU, gate-first halves, by hand)."""
    act = _swiglu(pre) if fast else activation_forward(spec, pre)
    _store_act(act, None if scales is None else scales.to(act.dtype).unsqueeze(-1), out)


def _store_act(act: torch.Tensor, scale_col: torch.Tensor | None, out: torch.Tensor) -> None:
    if scale_col is None:
        out.copy_(act)
    else:
        torch.mul(act, scale_col, out=out)


def _scale_grad(
    act: torch.Tensor, grad_out: torch.Tensor, scales: torch.Tensor | None, grad_scales: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(grad_out * scales, scale column)``, the scales' gradient written; ``(grad_out, None)`` unscaled."""
    if scales is None:
        return grad_out, None
    scale_col = scales.to(act.dtype).unsqueeze(-1)
    # row-wise sum(act * grad_out): products in the compute dtype, sums in fp32 (fp64 stays fp64)
    acc = torch.float64 if act.dtype == torch.float64 else torch.float32
    if grad_scales.dtype == acc:
        torch.sum(act * grad_out, dim=-1, dtype=acc, out=grad_scales)
    else:
        grad_scales.copy_((act * grad_out).sum(-1, dtype=acc))
    return grad_out * scale_col, scale_col


def _backward_block(
    spec: ActivationSpec,
    fast: bool,
    pre: torch.Tensor,
    scales: torch.Tensor | None,
    grad_out: torch.Tensor,
    grad_pre: torch.Tensor,
    grad_scales: torch.Tensor | None,
    act_out: torch.Tensor,
) -> None:
    """Activation backward for one row block; also writes the recomputed (scaled) activation.

    ``grad_out`` may be the same memory as ``act_out``: it is fully read before
    ``act_out`` is written. ``fast``: SwiGLU (gate-first halves) by hand; otherwise the
    reference math of :mod:`.activation`.
    """
    if not fast:
        act = activation_forward(spec, pre)
        grad_act, scale_col = _scale_grad(act, grad_out, scales, grad_scales)
        grad_pre.copy_(activation_backward(spec, pre, grad_act))
        _store_act(act, scale_col, act_out)
        return
    gate, linear = pre.chunk(2, dim=-1)  # one op for both halves
    grad_gate, grad_linear = grad_pre.chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    act = silu * linear
    grad_act, scale_col = _scale_grad(act, grad_out, scales, grad_scales)
    torch.mul(grad_act, silu, out=grad_linear)
    # d silu / d gate = sig + silu * (1 - sig); times linear for the gate's gradient
    dsilu = silu.addcmul_(silu, sig, value=-1).add_(sig).mul_(linear)
    torch.mul(grad_act, dsilu, out=grad_gate)
    _store_act(act, scale_col, act_out)


class TorchCpuBackend(TorchLoopBackend):
    """Per-group ``torch.mm`` GEMMs into ``out`` slices, activation+scale fused by row blocks."""

    name = "cpu"
    description = "per-group torch.mm into out slices, activation+scale fused in cache-sized row blocks"
    fused_activation = True
    writes_in_place = True
    #: bytes of ``pre`` per activation block: big enough that each torch op is a long
    #: parallel loop (few thread barriers), small enough that the block and its
    #: temporaries stay in the last-level cache
    block_bytes: int = 4 << 20
    #: fixed rows per block instead of ``block_bytes`` (tests use tiny blocks)
    row_block: int | None = None
    #: reuse large output storages once nothing refers to them (see :mod:`.cpu_buffer_pool`)
    reuse_buffers: bool = True

    #: problems of at most this many multiply-adds per GEMM when run as one dense GEMM
    #: over all groups (``groups * rows * out * in``) do exactly that: one ``torch.mm``
    #: instead of one per group, which at tiny shapes is dominated by per-call cost
    #: (measured: faster up to 2**24, slower at 2**27, see docs/benchmarks-cpu-kernels.md)
    small_problem_macs: int = 1 << 24

    def __init__(self) -> None:
        self.buffers = CpuBufferPool()
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def probe(self, device: torch.device, dtype: torch.dtype) -> str | None:
        if torch.device(device).type != "cpu":
            return f"{self.name}: only runs on CPU tensors, not {torch.device(device).type}"
        if not dtype.is_floating_point:
            return f"{self.name}: dtype {dtype} is not a floating-point dtype"
        return None

    def bind_mlp(self, spec, scale_after_fc2, operands):  # noqa: ANN001, ANN201
        from .bound import CpuBoundMLP  # it builds on this module

        return CpuBoundMLP(self, spec, scale_after_fc2, operands)

    # ------------------------------------------------------------ GEMM hooks (arguments checked, host sizes)
    # Without a caller buffer, a small problem whose groups cover every row takes
    # _grouped_mm's own result as the output; otherwise the loop backend's bodies below.
    def _fprop(self, x, weight, split_sizes, offsets, bias, out) -> torch.Tensor:
        groups, n_out, k_in = weight.shape
        if out is not None or not self._whole_grouped_mm(x, split_sizes, groups, n_out, k_in):
            return super()._fprop(x, weight, split_sizes, offsets, bias, out)
        y = torch._grouped_mm(x, weight.transpose(-2, -1), offs=self._offs(split_sizes))
        if bias is not None:
            y.add_(bias.index_select(0, self._group_tables(split_sizes, x.device, x.dtype)[2]))
        return y

    def _dgrad(self, grad_out, weight, split_sizes, offsets, out) -> torch.Tensor:
        whole = None if out is not None else self._whole_dgrad(grad_out, weight, split_sizes)
        return super()._dgrad(grad_out, weight, split_sizes, offsets, out) if whole is None else whole

    def _whole_dgrad(self, grad_out, weight, split_sizes) -> torch.Tensor | None:
        """The dgrad of a small problem whose groups cover every row, as one fresh
        ``_grouped_mm`` result; None when the problem is not one."""
        groups, n_out, k_in = weight.shape
        if not self._whole_grouped_mm(grad_out, split_sizes, groups, n_out, k_in):
            return None
        return torch._grouped_mm(grad_out, _dgrad_operand(weight), offs=self._offs(split_sizes))

    def _wgrad(self, grad_out, x, split_sizes, offsets, out) -> torch.Tensor:
        groups, n_out, k_in = len(split_sizes), grad_out.shape[1], x.shape[1]
        whole = self._whole_grouped_mm(x, split_sizes, groups, n_out, k_in)
        if out is not None or not (whole and self._grouped_mm_takes(grad_out, n_out, k_in)):
            return super()._wgrad(grad_out, x, split_sizes, offsets, out)
        return torch._grouped_mm(grad_out.t(), x, offs=self._offs(split_sizes))

    def _whole_grouped_mm(
        self, rows: torch.Tensor, sizes: list[int], groups: int, n_out: int, k_in: int
    ) -> bool:
        """A small problem whose groups cover every row: one ``_grouped_mm`` gives the whole result."""
        return (
            sum(sizes) == rows.shape[0]
            and self._is_small(groups, rows.shape[0], n_out, k_in)
            and self._grouped_mm_takes(rows, n_out, k_in)
        )

    # ------------------------------------------------------------ GEMM bodies (into ``out``)
    def _fprop_groups(self, x, weight, bias, sizes: list[int], out) -> None:
        groups, n_out, k_in = weight.shape
        covered = sum(sizes)
        if self._is_small(groups, covered, n_out, k_in) and self._grouped_mm_takes(x, n_out, k_in):
            result = torch._grouped_mm(x[:covered], weight.transpose(-2, -1), offs=self._offs(sizes))
            out[:covered].copy_(result)
            if bias is not None:
                out[:covered].add_(bias.index_select(0, self._group_tables(sizes, x.device, x.dtype)[2]))
            return
        if self._is_small(groups, covered, n_out, k_in):
            # one GEMM against every group's weight, then each row picks its group's columns
            _, flat_rows, group_ids = self._group_tables(sizes, x.device, x.dtype)
            every_group = torch.mm(x[:covered], weight.reshape(groups * n_out, k_in).t())
            torch.index_select(every_group.view(covered * groups, n_out), 0, flat_rows, out=out[:covered])
            if bias is not None:
                out[:covered].add_(bias.index_select(0, group_ids))
            return
        # the bias is added after torch.mm: faster than torch.addmm with oneDNN bf16 here
        for g, start, end in _row_ranges(sizes):
            torch.mm(x[start:end], weight[g].t(), out=out[start:end])
            if bias is not None:
                out[start:end].add_(bias[g])

    def _dgrad_groups(self, grad_out, weight, sizes: list[int], out) -> None:
        groups, n_out, k_in = weight.shape
        covered = sum(sizes)
        if self._is_small(groups, covered, n_out, k_in) and self._grouped_mm_takes(grad_out, n_out, k_in):
            result = torch._grouped_mm(grad_out[:covered], _dgrad_operand(weight), offs=self._offs(sizes))
            out[:covered].copy_(result)
            return
        if self._is_small(groups, covered, n_out, k_in):
            masked = self._mask_by_group(grad_out[:covered], sizes)
            torch.mm(masked, weight.reshape(groups * n_out, k_in), out=out[:covered])
            if _all_finite(out[:covered]):
                return
        super()._dgrad_groups(grad_out, weight, sizes, out)

    def _wgrad_groups(self, grad_out, x, sizes: list[int], out) -> None:
        groups, n_out, k_in = out.shape
        covered = sum(sizes)
        if self._is_small(groups, covered, n_out, k_in) and self._grouped_mm_takes(x, n_out, k_in):
            # grad_out.T of a row-major [M, N] is the column-major operand _grouped_mm wants
            out.copy_(torch._grouped_mm(grad_out[:covered].t(), x[:covered], offs=self._offs(sizes)))
            return
        if self._is_small(groups, covered, n_out, k_in) and out.is_contiguous():
            masked = self._mask_by_group(grad_out[:covered], sizes)  # empty groups -> zero rows of out
            torch.mm(masked.t(), x[:covered], out=out.view(groups * n_out, k_in))
            if _all_finite(out):
                return
        super()._wgrad_groups(grad_out, x, sizes, out)

    # ------------------------------------------------------------ fused hooks (arguments checked)
    def _fc1_fprop_act(self, x, weight, bias, split_sizes, offsets, activation, scales):
        """FC1, then ``act(pre) * scales`` by row blocks."""
        pre = self._fprop(x, weight, split_sizes, offsets, bias, None)
        fast = self._is_fast_swiglu(activation)
        block_rows = self._block_rows(pre)
        if fast and pre.shape[0] <= block_rows:  # one block: no output buffer, no copy into it
            act = _swiglu(pre)
            return pre, act if scales is None else act.mul_(scales.to(act.dtype).unsqueeze(-1))
        act = self._empty((pre.shape[0], activation.output_features(pre.shape[1])), pre)
        for s, e in _blocks(0, pre.shape[0], block_rows):
            _forward_block(activation, fast, pre[s:e], None if scales is None else scales[s:e], act[s:e])
        return pre, act

    def _fc2_dgrad_act(self, grad_y, weight, pre, split_sizes, offsets, activation, scales):
        """FC2 dgrad into the activation's memory, then the activation backward by row blocks.

        ``grad_act`` is computed into ``act``'s memory with whole-group GEMMs; each row block
        reads it and then overwrites it with the recomputed activation (no ``[M, F]`` temporary).
        """
        rows = grad_y.shape[0]
        grad_pre = self._empty(tuple(pre.shape), pre)
        grad_scales = None if scales is None else scales.new_empty(rows)
        covered = sum(split_sizes)
        act = self._whole_dgrad(grad_y, weight, split_sizes)  # fresh memory: no copy into a buffer
        if act is None:
            act = self._empty((rows, weight.shape[2]), pre)
            self._dgrad(grad_y, weight, split_sizes, offsets, act)  # writes the covered rows
        for tail in (grad_pre, act, grad_scales):
            if tail is not None and covered < rows:
                tail[covered:].zero_()
        fast = self._is_fast_swiglu(activation)
        block_rows = self._block_rows(pre)
        if covered == rows and rows <= block_rows:  # one block: the whole tensors, no slices
            _backward_block(activation, fast, pre, scales, act, grad_pre, grad_scales, act)
            return grad_pre, grad_scales, act
        for s, e in _blocks(0, covered, block_rows):
            block_scales = None if scales is None else scales[s:e]
            block_grad_scales = None if grad_scales is None else grad_scales[s:e]
            _backward_block(
                activation, fast, pre[s:e], block_scales, act[s:e], grad_pre[s:e], block_grad_scales, act[s:e]
            )
        return grad_pre, grad_scales, act

    # ------------------------------------------------------------ helpers
    def _is_small(self, groups: int, rows: int, n_out: int, k_in: int) -> bool:
        return rows > 0 and groups * rows * n_out * k_in <= self.small_problem_macs

    @staticmethod
    def _grouped_mm_takes(t: torch.Tensor, n_out: int, k_in: int) -> bool:
        """Whether one ``torch._grouped_mm`` call can run this small problem.

        Measured at 4 experts, 64 rows, 64 -> 128 (benchmarks/cpu_gemm_candidates.py): bf16
        149 us vs 259 us for the per-group loop and 788 us for the masked dense GEMM
        (no AMX: bf16 mm is slow, and the masked form does ``groups`` times the work);
        fp32 53 vs 90 vs 58 us. It needs bf16/fp16/fp32 and 16-byte aligned feature sizes.
        The answer depends on metadata only and is looked up (each GEMM of a call asks).
        """
        key = (t.dtype, t.stride(), n_out, k_in)
        takes = _GROUPED_MM_TAKES.get(key)
        if takes is None:
            takes = _grouped_mm_takes(*key)
            if len(_GROUPED_MM_TAKES) >= 256:
                _GROUPED_MM_TAKES.clear()
            _GROUPED_MM_TAKES[key] = takes
        return takes

    @staticmethod
    def _offs(sizes: list[int]) -> torch.Tensor:
        """int32 group end offsets ``[G]`` for host ``sizes``, shared (see ``splits.host_offsets``)."""
        return host_offsets(sizes)

    def _group_tables(
        self, sizes: list[int], device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(one_hot [c, G] of dtype, flat_rows [c], group_ids [c])`` for the covered rows, cached."""
        key = (tuple(sizes), device, dtype)
        tables = self._tables.get(key)
        if tables is None:
            groups = len(sizes)
            group_ids = torch.repeat_interleave(
                torch.arange(groups, device=device), torch.tensor(sizes, device=device)
            )
            flat_rows = torch.arange(group_ids.numel(), device=device) * groups + group_ids
            one_hot = torch.nn.functional.one_hot(group_ids, groups).to(dtype)
            tables = (one_hot, flat_rows, group_ids)
            if len(self._tables) >= 8:
                self._tables.pop(next(iter(self._tables)))
            self._tables[key] = tables
        return tables

    def _mask_by_group(self, rows: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """``[c, N] -> [c, G * N]``: each row in its group's column block, zeros elsewhere."""
        one_hot = self._group_tables(sizes, rows.device, rows.dtype)[0]
        return (one_hot.unsqueeze(-1) * rows.unsqueeze(1)).reshape(rows.shape[0], -1)

    def _empty(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        if self.reuse_buffers and math.prod(shape) * like.element_size() >= self.buffers.min_bytes:
            return self.buffers.empty(shape, like.dtype, like.device)
        return like.new_empty(shape)  # small: the allocator reuses these itself

    def _block_rows(self, pre: torch.Tensor) -> int:
        if self.row_block is not None:
            return max(1, self.row_block)
        row_bytes = max(1, pre.shape[1] * pre.element_size())
        return max(16, self.block_bytes // row_bytes)

    @staticmethod
    def _is_fast_swiglu(activation: ActivationSpec) -> bool:
        return activation.kind in HAND_FUSED_KINDS and activation.glu_interleave_size is None
