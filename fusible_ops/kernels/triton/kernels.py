"""Triton kernels for the grouped MLP: grouped GEMMs with device-resident row offsets.

The ``@triton.jit`` code only; :mod:`.triton_launch` holds the tile configurations and
launchers. Both are imported only from inside
:class:`~fusible_ops.kernels.triton.backend.TritonBackend` methods, never at package
import. Whether these kernels are compiled for the GPU or run by Triton's interpreter is decided by Triton when this module (and Triton itself) is
first imported: ``TRITON_INTERPRET=1`` must be set before that (see :data:`INTERPRETED`).

Shapes (``G`` groups, ``M`` rows): group ``g`` owns rows ``offsets[g-1]:offsets[g]``
(``offsets`` is an inclusive cumulative sum on the device), read by the kernels only.

Tile schedule: the row tiles of all groups are enumerated in one grid axis of
``cdiv(M, BLOCK_M) + G + 1`` entries (an upper bound on the number of tiles, since each
group wastes at most one partial tile). Each program finds its group from the offsets
with a vectorised cumulative sum; programs past the last tile exit at once. Rows in
``[offsets[-1], M)`` form a pseudo-group ``G`` ("the tail"): freshly allocated outputs
get zeros there; caller buffers are never written there.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# Activation codes (constexpr in the kernels).
_ACT_CODES = {
    "relu": 0,
    "gelu": 1,
    "silu": 2,
    "srelu": 3,
    "swiglu": 4,
    "geglu": 5,
    "reglu": 6,
    "clamped_swiglu": 7,
}

# ---------------------------------------------------------------- jit helpers


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _unary_fwd(x, KIND: tl.constexpr):
    """relu / gelu (tanh) / silu / squared relu of fp32 ``x``; KIND uses the unary codes."""
    if KIND == 0:
        y = tl.maximum(x, 0.0)
    elif KIND == 1:
        y = 0.5 * x * (1.0 + _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
    elif KIND == 2:
        y = x * tl.sigmoid(x)
    else:
        r = tl.maximum(x, 0.0)
        y = r * r
    return y


@triton.jit
def _unary_grad(x, KIND: tl.constexpr):
    """Derivative of :func:`_unary_fwd` at ``x``."""
    if KIND == 0:
        d = tl.where(x > 0.0, 1.0, 0.0)
    elif KIND == 1:
        t = _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x))
        dinner = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
        d = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dinner
    elif KIND == 2:
        s = tl.sigmoid(x)
        d = s * (1.0 + x * (1.0 - s))
    else:
        d = 2.0 * tl.maximum(x, 0.0)
    return d


@triton.jit
def _glu_gate(gate, KIND: tl.constexpr):
    """``(f(gate), f'(gate))`` for the gate function of swiglu (silu), geglu (gelu), reglu (relu)."""
    if KIND == 4:
        f = _unary_fwd(gate, 2)
        df = _unary_grad(gate, 2)
    elif KIND == 5:
        f = _unary_fwd(gate, 1)
        df = _unary_grad(gate, 1)
    else:
        f = _unary_fwd(gate, 0)
        df = _unary_grad(gate, 0)
    return f, df


@triton.jit
def _act_fwd(gate, lin, limit, alpha, glu_offset, KIND: tl.constexpr):
    """Activation of fp32 tiles; ``lin`` is ignored for the unary kinds (KIND < 4)."""
    if KIND < 4:
        y = _unary_fwd(gate, KIND)
    elif KIND == 7:
        g = tl.minimum(gate, limit)
        l = tl.minimum(tl.maximum(lin, -limit), limit)  # noqa: E741
        y = g * tl.sigmoid(alpha * g) * (l + glu_offset)
    else:
        f, _ = _glu_gate(gate, KIND)
        y = f * lin
    return y


@triton.jit
def _act_bwd(gate, lin, grad, limit, alpha, glu_offset, KIND: tl.constexpr):
    """Returns ``(act, grad_gate, grad_lin)`` for fp32 tiles; ``grad_lin`` is 0 for unary kinds."""
    if KIND < 4:
        act = _unary_fwd(gate, KIND)
        grad_gate = grad * _unary_grad(gate, KIND)
        grad_lin = grad * 0.0
    elif KIND == 7:
        g = tl.minimum(gate, limit)
        l = tl.minimum(tl.maximum(lin, -limit), limit)  # noqa: E741
        sig = tl.sigmoid(alpha * g)
        glu = g * sig
        act = glu * (l + glu_offset)
        dglu = sig * (1.0 + alpha * g * (1.0 - sig))
        grad_gate = tl.where(gate <= limit, grad * (l + glu_offset) * dglu, 0.0)
        grad_lin = tl.where((lin >= -limit) & (lin <= limit), grad * glu, 0.0)
    else:
        f, df = _glu_gate(gate, KIND)
        act = f * lin
        grad_gate = grad * lin * df
        grad_lin = grad * f
    return act, grad_gate, grad_lin


@triton.jit
def _swizzle(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Map a 1-D program id to (row tile, column tile), GROUP_M row tiles at a time (L2 reuse)."""
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def _row_tile(tile, offsets_ptr, G, M, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
    """Group and row range of row tile ``tile``: ``(group, row_start, row_end)``.

    ``group == G`` is the tail ``[offsets[-1], M)``; ``group > G`` means past the last tile.
    Offsets are clamped to ``[0, M]`` so malformed offsets cannot address memory out of range.
    """
    g = tl.arange(0, BLOCK_G)
    ends = tl.load(offsets_ptr + g, mask=g < G, other=0).to(tl.int32)
    starts = tl.load(offsets_ptr + g - 1, mask=(g > 0) & (g < G), other=0).to(tl.int32)
    last = tl.load(offsets_ptr + G - 1).to(tl.int32)
    ends = tl.where(g == G, M, ends)
    starts = tl.where(g == G, last, starts)
    ends = tl.minimum(tl.maximum(ends, 0), M)
    starts = tl.minimum(tl.maximum(starts, 0), M)
    counts = tl.maximum(ends - starts, 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(tiles, 0)
    group = tl.sum((cum <= tile).to(tl.int32), 0)
    sel = g == group
    first_tile = tl.sum(tl.where(sel, cum - tiles, 0), 0)
    row_start = tl.sum(tl.where(sel, starts, 0), 0) + (tile - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(sel, ends, 0), 0)
    return group, row_start, row_end


# ---------------------------------------------------------------- kernels


@triton.jit
def _grouped_mm_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr, offsets_ptr,
    M, R, J, G, M_BUCKET,
    stride_am, stride_ar,
    stride_bg, stride_br, stride_bj,
    stride_biasg, stride_biasj,
    stride_cm, stride_cj,
    HAS_BIAS: tl.constexpr, ZERO_TAIL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """``c[rows_g] = a[rows_g] @ b[g] (+ bias[g])`` with ``a [M, R]``, ``b [G, R, J]``, ``c [M, J]``."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M) + G + 1
    num_pid_n = tl.cdiv(J, BLOCK_N)
    pid_m, pid_n = _swizzle(pid, num_pid_m, num_pid_n, GROUP_M)
    group, row_start, row_end = _row_tile(pid_m, offsets_ptr, G, M, BLOCK_M, BLOCK_G)

    rows = row_start + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rows < row_end
    mask_j = cols < J
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :] * stride_cj
    c_mask = mask_m[:, None] & mask_j[None, :]
    if group < G:
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :] * stride_ar
        b_ptrs = b_ptr + group.to(tl.int64) * stride_bg + ks[:, None] * stride_br + cols[None, :] * stride_bj
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, R, BLOCK_K):
            a = tl.load(a_ptrs, mask=mask_m[:, None] & (ks[None, :] < R - k0), other=0.0)
            b = tl.load(b_ptrs, mask=(ks[:, None] < R - k0) & mask_j[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K * stride_ar
            b_ptrs += BLOCK_K * stride_br
        if HAS_BIAS:
            bias = tl.load(bias_ptr + group * stride_biasg + cols * stride_biasj, mask=mask_j, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)
    elif group == G:
        if ZERO_TAIL:
            tl.store(c_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=c_ptr.dtype.element_ty), mask=c_mask)


@triton.jit
def _gated_columns(cols, N_ACT, GATED: tl.constexpr, INTERLEAVE: tl.constexpr):
    """Columns of the gate and linear parts in the ``[.., 2n]`` pre-activation for act columns ``cols``."""
    if GATED:
        if INTERLEAVE == 0:
            gate_cols = cols
            lin_cols = cols + N_ACT
        else:
            gate_cols = (cols // INTERLEAVE) * (2 * INTERLEAVE) + cols % INTERLEAVE
            lin_cols = gate_cols + INTERLEAVE
    else:
        gate_cols = cols
        lin_cols = cols
    return gate_cols, lin_cols


@triton.jit
def _act_tile(
    offsets_ptr, M, N_ACT, G,
    GATED: tl.constexpr, INTERLEAVE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """One program's tile in the fused activation kernels: its column tile, group, rows,
    activation columns, masks, and the gate / linear columns those read in ``pre``."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M) + G + 1
    num_pid_n = tl.cdiv(N_ACT, BLOCK_N)
    pid_m, pid_n = _swizzle(pid, num_pid_m, num_pid_n, GROUP_M)
    group, row_start, row_end = _row_tile(pid_m, offsets_ptr, G, M, BLOCK_M, BLOCK_G)
    rows = row_start + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    gate_cols, lin_cols = _gated_columns(cols, N_ACT, GATED, INTERLEAVE)
    return pid_n, group, rows, cols, rows < row_end, cols < N_ACT, gate_cols, lin_cols


@triton.jit
def _fc1_act_kernel(
    x_ptr, w_ptr, bias_ptr, scales_ptr, pre_ptr, act_ptr, offsets_ptr,
    M, N_ACT, K, G, M_BUCKET,
    limit, alpha, glu_offset,
    stride_xm, stride_xk,
    stride_wg, stride_wn, stride_wk,
    stride_biasg, stride_biasn,
    stride_s,
    stride_pm, stride_pn,
    stride_actm, stride_actn,
    KIND: tl.constexpr, GATED: tl.constexpr, INTERLEAVE: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """``pre = x @ w[g].T (+ bias[g])`` and ``act = act(pre) * scales[:, None]``.

    ``x [M, K]``, ``w [G, N_pre, K]``, ``pre [M, N_pre]``, ``act [M, N_ACT]`` with
    ``N_pre = 2 * N_ACT`` for gated kinds. Each program owns ``BLOCK_N`` activation
    columns and accumulates the matching gate and linear columns side by side, so the
    activation runs in the epilogue. The activation reads ``pre`` rounded to its dtype,
    exactly what the backward pass will recompute it from.
    """
    pid_n, group, rows, cols, mask_m, mask_j, gate_cols, lin_cols = _act_tile(
        offsets_ptr, M, N_ACT, G, GATED, INTERLEAVE, BLOCK_M, BLOCK_N, BLOCK_G, GROUP_M
    )
    mask = mask_m[:, None] & mask_j[None, :]
    rows64 = rows[:, None].to(tl.int64)
    pre_gate_ptrs = pre_ptr + rows64 * stride_pm + gate_cols[None, :] * stride_pn
    pre_lin_ptrs = pre_ptr + rows64 * stride_pm + lin_cols[None, :] * stride_pn
    act_ptrs = act_ptr + rows64 * stride_actm + cols[None, :] * stride_actn
    if group < G:
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows64 * stride_xm + ks[None, :] * stride_xk
        w_base = w_ptr + group.to(tl.int64) * stride_wg + ks[:, None] * stride_wk
        wg_ptrs = w_base + gate_cols[None, :].to(tl.int64) * stride_wn
        wl_ptrs = w_base + lin_cols[None, :].to(tl.int64) * stride_wn
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_lin = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask_k = ks < K - k0
            x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            wg = tl.load(wg_ptrs, mask=mask_k[:, None] & mask_j[None, :], other=0.0)
            acc_gate = tl.dot(x, wg, acc_gate)
            if GATED:
                wl = tl.load(wl_ptrs, mask=mask_k[:, None] & mask_j[None, :], other=0.0)
                acc_lin = tl.dot(x, wl, acc_lin)
            x_ptrs += BLOCK_K * stride_xk
            wg_ptrs += BLOCK_K * stride_wk
            wl_ptrs += BLOCK_K * stride_wk
        if HAS_BIAS:
            bias_base = bias_ptr + group * stride_biasg
            acc_gate += tl.load(bias_base + gate_cols * stride_biasn, mask=mask_j, other=0.0).to(tl.float32)[
                None, :
            ]
            if GATED:
                acc_lin += tl.load(bias_base + lin_cols * stride_biasn, mask=mask_j, other=0.0).to(
                    tl.float32
                )[None, :]
        pre_gate = acc_gate.to(pre_ptr.dtype.element_ty)
        tl.store(pre_gate_ptrs, pre_gate, mask=mask)
        pre_lin = acc_lin.to(pre_ptr.dtype.element_ty)
        if GATED:
            tl.store(pre_lin_ptrs, pre_lin, mask=mask)
        act = _act_fwd(pre_gate.to(tl.float32), pre_lin.to(tl.float32), limit, alpha, glu_offset, KIND)
        if HAS_SCALES:
            s = tl.load(scales_ptr + rows.to(tl.int64) * stride_s, mask=mask_m, other=0.0).to(tl.float32)
            act = act * s[:, None]
        tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=mask)
    elif group == G:
        tl.store(pre_gate_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=pre_ptr.dtype.element_ty), mask=mask)
        if GATED:
            tl.store(pre_lin_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=pre_ptr.dtype.element_ty), mask=mask)
        tl.store(act_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=act_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fc2_dgrad_act_kernel(
    dy_ptr, w_ptr, pre_ptr, scales_ptr, grad_pre_ptr, act_ptr, partial_ptr, offsets_ptr,
    M, N_ACT, H, G, M_BUCKET,
    limit, alpha, glu_offset,
    stride_dym, stride_dyh,
    stride_wg, stride_wh, stride_wn,
    stride_pm, stride_pn,
    stride_s,
    stride_gm, stride_gn,
    stride_actm, stride_actn,
    KIND: tl.constexpr, GATED: tl.constexpr, INTERLEAVE: tl.constexpr, HAS_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """FC2 dgrad with the activation backward in the epilogue.

    ``grad_act = dy @ w[g]`` (``dy [M, H]``, ``w [G, H, N_ACT]``) stays in registers; the
    epilogue recomputes ``act`` from ``pre`` and writes ``grad_pre [M, N_pre]``, the FC2
    input ``act * s [M, N_ACT]`` (for FC2's weight gradient) and, per column tile, the
    partial row sums ``sum_j act * grad_act`` into ``partial [num_col_tiles, M]`` (fp32),
    which the launcher reduces into the scales' gradient (deterministic: no atomics).
    """
    pid_n, group, rows, cols, mask_m, mask_j, gate_cols, lin_cols = _act_tile(
        offsets_ptr, M, N_ACT, G, GATED, INTERLEAVE, BLOCK_M, BLOCK_N, BLOCK_G, GROUP_M
    )
    mask = mask_m[:, None] & mask_j[None, :]
    rows64 = rows[:, None].to(tl.int64)
    gp_gate_ptrs = grad_pre_ptr + rows64 * stride_gm + gate_cols[None, :] * stride_gn
    gp_lin_ptrs = grad_pre_ptr + rows64 * stride_gm + lin_cols[None, :] * stride_gn
    act_ptrs = act_ptr + rows64 * stride_actm + cols[None, :] * stride_actn
    partial_ptrs = partial_ptr + pid_n.to(tl.int64) * M + rows
    if group < G:
        ks = tl.arange(0, BLOCK_K)
        dy_ptrs = dy_ptr + rows64 * stride_dym + ks[None, :] * stride_dyh
        w_ptrs = w_ptr + group.to(tl.int64) * stride_wg + ks[:, None] * stride_wh + cols[None, :] * stride_wn
        grad_act = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            mask_k = ks < H - k0
            dy = tl.load(dy_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_j[None, :], other=0.0)
            grad_act = tl.dot(dy, w, grad_act)
            dy_ptrs += BLOCK_K * stride_dyh
            w_ptrs += BLOCK_K * stride_wh
        pre_gate = tl.load(
            pre_ptr + rows64 * stride_pm + gate_cols[None, :] * stride_pn, mask=mask, other=0.0
        )
        pre_gate = pre_gate.to(tl.float32)
        if GATED:
            pre_lin = tl.load(
                pre_ptr + rows64 * stride_pm + lin_cols[None, :] * stride_pn, mask=mask, other=0.0
            )
            pre_lin = pre_lin.to(tl.float32)
        else:
            pre_lin = pre_gate
        if HAS_SCALES:
            s = tl.load(scales_ptr + rows.to(tl.int64) * stride_s, mask=mask_m, other=0.0).to(tl.float32)
            grad_scaled = grad_act * s[:, None]
        else:
            grad_scaled = grad_act
        act, grad_gate, grad_lin = _act_bwd(pre_gate, pre_lin, grad_scaled, limit, alpha, glu_offset, KIND)
        tl.store(gp_gate_ptrs, grad_gate.to(grad_pre_ptr.dtype.element_ty), mask=mask)
        if GATED:
            tl.store(gp_lin_ptrs, grad_lin.to(grad_pre_ptr.dtype.element_ty), mask=mask)
        if HAS_SCALES:
            # act rounded to its dtype, as the unfused path sees it
            act_rounded = act.to(act_ptr.dtype.element_ty).to(tl.float32)
            tl.store(partial_ptrs, tl.sum(tl.where(mask, act_rounded * grad_act, 0.0), 1), mask=mask_m)
            act = act * s[:, None]
        tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=mask)
    elif group == G:
        tl.store(gp_gate_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=grad_pre_ptr.dtype.element_ty), mask=mask)
        if GATED:
            tl.store(
                gp_lin_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=grad_pre_ptr.dtype.element_ty), mask=mask
            )
        tl.store(act_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=act_ptr.dtype.element_ty), mask=mask)
        if HAS_SCALES:
            tl.store(partial_ptrs, tl.zeros((BLOCK_M,), dtype=tl.float32), mask=mask_m)


@triton.jit
def _wgrad_kernel(
    dy_ptr, x_ptr, out_ptr, offsets_ptr,
    M, N, K, G, M_BUCKET,
    stride_dym, stride_dyn,
    stride_xm, stride_xk,
    stride_og, stride_on, stride_ok,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """``out[g] = dy[rows_g].T @ x[rows_g]``: a grouped GEMM whose reduction dim is ragged.

    ``dy [M, N]``, ``x [M, K]``, ``out [G, N, K]``; a group without rows gets zeros.
    """
    pid = tl.program_id(0)
    group = tl.program_id(1)
    pid_n, pid_k = _swizzle(pid, tl.cdiv(N, BLOCK_N), tl.cdiv(K, BLOCK_K), GROUP_M)
    row_end = tl.minimum(tl.maximum(tl.load(offsets_ptr + group).to(tl.int32), 0), M)
    row_start = tl.load(offsets_ptr + group - 1, mask=group > 0, other=0).to(tl.int32)
    row_start = tl.minimum(tl.maximum(row_start, 0), M)

    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    ms = tl.arange(0, BLOCK_M)
    mask_n = ns < N
    mask_k = ks < K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m0 in range(row_start, row_end, BLOCK_M):
        rows = m0 + ms
        mask_m = rows < row_end
        rows64 = rows.to(tl.int64)
        dy_t = tl.load(
            dy_ptr + rows64[None, :] * stride_dym + ns[:, None] * stride_dyn,
            mask=mask_n[:, None] & mask_m[None, :],
            other=0.0,
        )
        x = tl.load(
            x_ptr + rows64[:, None] * stride_xm + ks[None, :] * stride_xk,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        acc = tl.dot(dy_t, x, acc)
    out_ptrs = out_ptr + group.to(tl.int64) * stride_og + ns[:, None] * stride_on + ks[None, :] * stride_ok
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_k[None, :])


#: True when Triton runs these kernels in its interpreter (``TRITON_INTERPRET=1`` at import).
INTERPRETED: bool = isinstance(_grouped_mm_kernel, InterpretedFunction)
