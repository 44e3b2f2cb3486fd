"""Preparation logic for the cuDNN frontend grouped-GEMM wrappers, as pure torch functions.

The Blackwell kernels have rules the rest of the library must not see:

- **256-row expert alignment**: every expert's rows start at a multiple of 256 in the
  kernel's ``A``/``C``/``D`` tensors (``padded_offsets`` are the inclusive ends). Caller
  rows are scattered into a zero-filled padded buffer through ``row_map`` and results
  are gathered back, so padded rows never reach the caller. When every group already
  has a multiple of 256 rows the layout is the identity and no copy is made.
- **GLU column layout**: the GLU epilogue pairs alternating 32-column gate / linear
  blocks of ``C``. fc1's weight rows (and bias) are reordered into that layout and
  ``pre`` / ``grad_pre`` are mapped back to the caller's gate/linear convention.
- **MXFP8 scale factors**: one E8M0 scale per 32 values along K, stored in the MMA-tiled
  order ``(groups, ceil(rows/128), ceil(cols/4), 32, 4, 4)``; the logical 6-D view the
  frontend documents is ``(32, 4, ceil(rows/128), 4, ceil(cols/4), groups)``.

Nothing here imports ``cudnn``; the ``*_kwargs`` functions return the keyword arguments
for each wrapper, so the mapping is tested on CPU against a fake of the wrappers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...recipes.formats import E4M3, cast_saturated
from ...recipes.scales import e8m0_bytes, mx_scales
from ..activation import ACTIVATIONS, ActivationSpec, split_gate_linear

M_ALIGN = 256
GLU_BLOCK = 32
MX_BLOCK = 32
SF_TILE_ROWS = 128
SF_TILE_COLS = 4


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------- row padding


@dataclass(frozen=True)
class PaddedRows:
    """Where each caller row lives in the kernel's 256-aligned row space.

    ``padded_offsets``: int32 ``[G]`` inclusive ends; ``row_map``: int64 ``[M]`` padded row
    of caller row ``i`` (None when ``identity``); ``capacity``: rows to allocate (a
    multiple of 256, at least ``padded_offsets[-1]``).
    """

    padded_offsets: torch.Tensor
    row_map: torch.Tensor | None
    num_rows: int
    capacity: int
    identity: bool


def pad_rows(
    split_sizes: list[int] | None, offsets: torch.Tensor, num_rows: int, align: int = M_ALIGN
) -> PaddedRows:
    """Padded layout for groups ending at ``offsets`` (int ``[G]``, inclusive cumsum).

    With host ``split_sizes`` the capacity is exact and the identity case is detected;
    with ``None`` everything stays on device (no sync) and the capacity is the bound
    ``round_up(M + G * (align - 1), align)``.
    """
    num_groups = offsets.shape[0]
    device = offsets.device
    if split_sizes is not None:
        if len(split_sizes) != num_groups or sum(split_sizes) != num_rows:
            raise ValueError(
                f"cudnn adapter: split_sizes {split_sizes} do not match {num_groups} groups / {num_rows} rows"
            )
        padded = [_ceil_div(s, align) * align for s in split_sizes]
        identity = padded == list(split_sizes)
        ends = torch.tensor(padded, dtype=torch.int64).cumsum(0)
        padded_offsets = ends.to(device=device, dtype=torch.int32)
        capacity = int(ends[-1]) if num_groups else 0
        if identity:
            return PaddedRows(padded_offsets, None, num_rows, capacity, True)
    else:
        capacity = _ceil_div(num_rows + num_groups * (align - 1), align) * align
    ends = offsets.to(torch.int64)
    sizes = torch.diff(ends, prepend=ends.new_zeros(1))
    padded_sizes = (sizes + align - 1) // align * align
    padded_ends = padded_sizes.cumsum(0)
    shift = (padded_ends - padded_sizes) - (ends - sizes)  # padded start - caller start, per group
    rows = torch.arange(num_rows, device=device, dtype=torch.int64)
    group_ids = torch.searchsorted(ends, rows, right=True)
    row_map = rows + shift[group_ids]
    return PaddedRows(padded_ends.to(torch.int32), row_map, num_rows, capacity, False)


def scatter_rows(x: torch.Tensor, layout: PaddedRows, fill: float = 0.0) -> torch.Tensor:
    """``[capacity, ...]`` copy of ``x`` ``[M, ...]`` in padded row space (``x`` itself if identity)."""
    if layout.identity:
        return x.contiguous()
    buf = x.new_full((layout.capacity, *x.shape[1:]), fill)
    buf.index_copy_(0, layout.row_map, x.contiguous())
    return buf


def gather_rows(padded: torch.Tensor, layout: PaddedRows, out: torch.Tensor | None = None) -> torch.Tensor:
    """Caller rows ``[M, ...]`` of ``padded``; writes into ``out`` when given (no-op if it is ``padded``)."""
    if layout.identity:
        rows = padded[: layout.num_rows]
        if out is None:
            return rows
        if out.data_ptr() != padded.data_ptr():
            out.copy_(rows)
        return out
    if out is None:
        return padded.index_select(0, layout.row_map)
    return torch.index_select(padded, 0, layout.row_map, out=out)


def output_target(
    layout: PaddedRows, out: torch.Tensor | None, cols: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, bool]:
    """The tensor a wrapper should write (``d_tensor``) and whether it is the caller's ``out``.

    The kernel can take ``out`` directly only when rows need no padding. Otherwise it
    writes a padded scratch and :func:`gather_rows` does the one documented copy.
    """
    if out is not None and layout.identity and out.is_contiguous():
        return out, True
    return torch.empty(layout.capacity, cols, dtype=dtype, device=device), False


# ---------------------------------------------------------------- GLU columns


def glu_kernel_column_order(two_n: int, interleave: int | None) -> torch.Tensor:
    """``perm`` with kernel column ``j`` = caller column ``perm[j]`` (int64 ``[2n]``).

    The kernel's layout is alternating ``GLU_BLOCK``-wide gate / linear blocks; the
    caller's is halves (``interleave`` None) or ``interleave``-wide blocks.
    """
    if two_n % (2 * GLU_BLOCK) != 0:
        raise ValueError(f"cudnn GLU kernels need 2*ffn divisible by {2 * GLU_BLOCK}, got {two_n}")
    cols = torch.arange(two_n)
    gate, linear = split_gate_linear(cols, interleave)
    blocks = torch.stack([gate.view(-1, GLU_BLOCK), linear.view(-1, GLU_BLOCK)], dim=1)
    return blocks.reshape(two_n)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device=perm.device)
    return inv


def is_identity_permutation(perm: torch.Tensor) -> bool:
    return bool(torch.equal(perm, torch.arange(perm.numel(), device=perm.device)))


def glu_unsupported_reason(spec: ActivationSpec) -> str | None:
    """Why the fused GLU kernels cannot compute ``spec`` (None when they can)."""
    if "cudnn" in ACTIVATIONS[spec.kind].epilogue_backends:  # the activation table
        return None
    if spec.kind == "geglu":
        return "the frontend's 'geglu' is the clamped GPT-OSS form, not tanh-GELU GEGLU"
    return f"no fused cuDNN GLU kernel for activation {spec.kind!r}"


def glu_activation_kwargs(spec: ActivationSpec, *, backward: bool = False) -> dict:
    """Wrapper activation arguments for ``spec`` (forward: ``act_func``; backward: ``d`` prefix)."""
    reason = glu_unsupported_reason(spec)
    if reason is not None:
        raise ValueError(f"cudnn backend: {reason}")
    prefix = "d" if backward else ""
    if spec.kind == "swiglu":
        return {"act_func": prefix + "swiglu"}
    # The frontend's "geglu" is clamp(gate, max=L) * sigmoid(alpha * gate) * (clamp(lin, -L, L) + offset).
    return {
        "act_func": prefix + "geglu",
        "geglu_alpha": float(spec.alpha),
        "glu_clamp_max": float(spec.limit),
        "glu_clamp_min": -float(spec.limit),
        "linear_offset": float(spec.glu_linear_offset),
    }


def bias_kernel_layout(bias: torch.Tensor, perm: torch.Tensor | None = None) -> torch.Tensor:
    """``[G, N]`` bias as the kernels' ``(N, G)`` tensor with stride ``(1, N)``."""
    b = bias if perm is None else bias.index_select(1, perm.to(bias.device))
    return b.contiguous().t()


def expert_pointers(weight: torch.Tensor) -> torch.Tensor:
    """int64 ``[G]`` data pointers of ``weight[g]`` (discrete-weight mode), on ``weight.device``.

    Host arithmetic on metadata only; the small tensor is copied to the device.
    """
    step = weight.stride(0) * weight.element_size()
    ptrs = [weight.data_ptr() + g * step for g in range(weight.shape[0])]
    return torch.tensor(ptrs, dtype=torch.int64).to(weight.device, non_blocking=True)


# ---------------------------------------------------------------- MXFP8


def mx_packed_shape(rows: int, cols: int, groups: int = 1, sf_vec_size: int = MX_BLOCK) -> tuple[int, ...]:
    """Physical (contiguous) packed scale-buffer shape, ``512 * tiles`` bytes per group."""
    rest_k = _ceil_div(_ceil_div(cols, sf_vec_size), SF_TILE_COLS)
    return (groups, _ceil_div(rows, SF_TILE_ROWS), rest_k, 32, 4, 4)


def pack_scales(scales: torch.Tensor) -> torch.Tensor:
    """``[G, rows, cols_sf]`` uint8 exponents -> contiguous packed ``mx_packed_shape`` buffer.

    Row ``r`` of a 128-row tile lands at ``(r % 32, r // 32)``; padding bytes are 127 (2^0).
    """
    groups, rows, cols_sf = scales.shape
    rest_m, rest_k = _ceil_div(rows, SF_TILE_ROWS), _ceil_div(cols_sf, SF_TILE_COLS)
    padded = scales.new_full((groups, rest_m * SF_TILE_ROWS, rest_k * SF_TILE_COLS), 127)
    padded[:, :rows, :cols_sf] = scales
    tiles = padded.view(groups, rest_m, 4, 32, rest_k, 4)  # row = (tile, r // 32, r % 32)
    return tiles.permute(0, 1, 4, 3, 2, 5).contiguous()


def mxfp8_quantize(x: torch.Tensor, rounding: str = "floor") -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantise ``x`` ``[..., cols]`` along the last dim (32 values per E8M0 scale),
    with the recipes' scale rule (:func:`fusible_ops.recipes.scales.mx_scales`; ``rounding``
    ``"floor"``, the OCP rule, or ``"rceil"``).

    Returns ``(q, exponents)``: ``q`` float8_e4m3fn like ``x``; ``exponents`` uint8
    ``[..., ceil(cols/32)]`` biased by 127 (the E8M0 bit pattern; 0xFF for a block holding
    a NaN or an Inf, whose values dequantize to NaN).
    """
    cols = x.shape[-1]
    nblocks = _ceil_div(cols, MX_BLOCK)
    xf = torch.nn.functional.pad(x.float(), (0, nblocks * MX_BLOCK - cols))
    blocks = xf.view(*x.shape[:-1], nblocks, MX_BLOCK)
    multiplier, scale_inv = mx_scales(blocks.abs().amax(-1), E4M3, rounding)
    q = cast_saturated(blocks * multiplier.unsqueeze(-1), E4M3)
    return q.view(*x.shape[:-1], nblocks * MX_BLOCK)[..., :cols], e8m0_bytes(scale_inv)


def as_e8m0(exponents: torch.Tensor) -> torch.Tensor:
    """Reinterpret uint8 exponent bytes as ``torch.float8_e8m0fnu`` (no copy)."""
    return exponents.view(torch.float8_e8m0fnu)


def mxfp8_operand(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[rows, K]`` or ``[G, rows, K]`` -> (fp8 data, packed E8M0 scale buffer)."""
    q, exps = mxfp8_quantize(x)
    grouped = exps if exps.dim() == 3 else exps.unsqueeze(0)
    return q, as_e8m0(pack_scales(grouped))


# ---------------------------------------------------------------- wrapper arguments


def _dense_operands(a, sfa, padded_offsets, alpha, weight, sfb, bias) -> dict:
    """The operand arguments the GLU and MXFP8 wrappers share (dense ``weight`` ``[G, N, K]``)."""
    return dict(
        a_tensor=a,
        sfa_tensor=sfa,
        padded_offsets=padded_offsets,
        alpha_tensor=alpha,
        b_tensor=weight,
        sfb_tensor=sfb,
        bias_tensor=bias,
    )


def glu_forward_kwargs(
    *,
    a: torch.Tensor,
    weight: torch.Tensor,
    padded_offsets: torch.Tensor,
    alpha: torch.Tensor,
    prob: torch.Tensor,
    bias: torch.Tensor | None,
    spec: ActivationSpec,
    out_dtype: torch.dtype,
    sfa: torch.Tensor | None = None,
    sfb: torch.Tensor | None = None,
    norm_const: torch.Tensor | None = None,
) -> dict:
    """``grouped_gemm_glu_wrapper_sm100``: ``a`` ``[cap, K]``, ``weight`` ``[G, 2n, K]`` in kernel order."""
    kwargs = _dense_operands(a, sfa, padded_offsets, alpha, weight, sfb, bias)
    kwargs.update(
        prob_tensor=prob, c_dtype=out_dtype, d_dtype=out_dtype, generate_c=True, **glu_activation_kwargs(spec)
    )
    if sfa is not None:
        kwargs.update(sf_vec_size=MX_BLOCK, norm_const_tensor=norm_const)
    return kwargs


def grouped_gemm_kwargs(
    *,
    a: torch.Tensor,
    padded_offsets: torch.Tensor,
    alpha: torch.Tensor,
    d_tensor: torch.Tensor,
    out_dtype: torch.dtype,
    weight: torch.Tensor | None = None,
    b_ptrs: torch.Tensor | None = None,
    n: int | None = None,
    bias: torch.Tensor | None = None,
    prob: torch.Tensor | None = None,
) -> dict:
    """``grouped_gemm_wrapper_sm100`` (BF16): dense ``weight`` ``[G, N, K]`` or discrete
    N-major ``b_ptrs`` (each expert an ``[K, N]`` row-major matrix, as for dgrad).

    The wrapper requires a per-row ``prob_tensor`` (fp32 ``[rows]``) that scales each
    output row; plain GEMMs pass ones (the default).
    """
    if prob is None:
        prob = torch.ones(a.shape[0], dtype=torch.float32, device=a.device)
    kwargs = dict(
        a_tensor=a,
        padded_offsets=padded_offsets,
        alpha_tensor=alpha,
        bias_tensor=bias,
        prob_tensor=prob,
        d_dtype=out_dtype,
    )
    kwargs["d_tensor"] = d_tensor
    if weight is not None:
        kwargs["b_tensor"] = weight
    else:
        kwargs.update(b_ptrs=b_ptrs, n=n, b_dtype=out_dtype, b_major="n")
    return kwargs


def quant_gemm_kwargs(
    *,
    a: torch.Tensor,
    sfa: torch.Tensor,
    padded_offsets: torch.Tensor,
    alpha: torch.Tensor,
    weight: torch.Tensor,
    sfb: torch.Tensor,
    d_tensor: torch.Tensor,
    out_dtype: torch.dtype,
    norm_const: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> dict:
    """``grouped_gemm_quant_wrapper_sm100`` (MXFP8 in, ``out_dtype`` out, written into ``d_tensor``)."""
    kwargs = _dense_operands(a, sfa, padded_offsets, alpha, weight, sfb, bias)
    kwargs.update(norm_const_tensor=norm_const, d_dtype=out_dtype, d_tensor=d_tensor, sf_vec_size=MX_BLOCK)
    return kwargs


def dglu_kwargs(
    *,
    grad: torch.Tensor,
    pre: torch.Tensor,
    padded_offsets: torch.Tensor,
    prob: torch.Tensor,
    dprob: torch.Tensor,
    fc2_weight: torch.Tensor,
    spec: ActivationSpec,
    out_dtype: torch.dtype,
) -> dict:
    """``grouped_gemm_dglu_wrapper_sm100`` (BF16): ``grad`` ``[cap, H]``, ``pre`` ``[cap, 2n]`` in
    kernel column order, fc2 ``weight`` ``[G, H, n]`` bound per expert as N-major ``(n, H)``."""
    num_groups, _, n = fc2_weight.shape
    ones = torch.ones(num_groups, dtype=torch.float32, device=grad.device)
    return dict(
        a_tensor=grad,
        c_tensor=pre,
        sfa_tensor=None,
        padded_offsets=padded_offsets,
        alpha_tensor=ones,
        beta_tensor=ones,
        prob_tensor=prob,
        dprob_tensor=dprob,
        b_ptrs=expert_pointers(fc2_weight),
        n=n,
        b_dtype=fc2_weight.dtype,
        b_major="n",
        d_dtype=out_dtype,
        **glu_activation_kwargs(spec, backward=True),
    )


def wgrad_kwargs(
    *, grad_out: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor
) -> dict:
    """``grouped_gemm_wgrad_wrapper_sm100`` (BF16): ``out[g] = grad_out[rows_g].T @ x[rows_g]``.

    A is ``grad_out.T`` (an M-major view, no copy), B is ``x`` (N-major), and the
    unpadded ``offsets`` segment the token axis.
    """
    return dict(
        a_tensor=grad_out.t(),
        b_tensor=x,
        sfa_tensor=None,
        sfb_tensor=None,
        offsets_tensor=offsets.to(torch.int32),
        wgrad_tensor=out,
        wgrad_dtype=out.dtype,
    )


def hopper_matmul_operands(
    x: torch.Tensor, weight_kn: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Operands of the graph-API ``moe_grouped_matmul``: token ``(1, M, K)``, weight
    ``(G, K, N)`` (any strides), ``first_token_offset`` int32 ``(G+1, 1, 1)`` = ``[0, offsets]``."""
    token = x.contiguous().unsqueeze(0)
    bounds = torch.cat([offsets.new_zeros(1), offsets]).to(torch.int32)
    return token, weight_kn, bounds.view(-1, 1, 1)
